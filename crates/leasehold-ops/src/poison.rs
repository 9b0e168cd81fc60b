//! The poison queue: list, show, requeue and purge what was given up.
//!
//! Azure queues can show (peek) only the first 32 visible messages, and can delete or change a
//! message only with the receipt of taking it. So anything beyond a peek *scans*: it takes the
//! entries 32 at a time, hiding each for a short while ([`SCAN_HIDE`], 30 s) and hiding it again
//! before that ends for as long as the scan holds it; it acts on the ones selected and puts the
//! others back (visible at once) when it ends, is interrupted or fails. If the scan dies, what it
//! held comes back by itself within the short hiding: nothing is lost, and nothing stays out of
//! sight for long, however deep the queue.
//!
//! A scan holds only what it needs of an entry: its id and receipt (an update that sends no body
//! keeps the body in the queue), and for a listing a preview of the reason and body; and at most
//! [`SCAN_HOLD_MAX`] entries at once (a listing stops there and says so).
//!
//! A requeue or purge ends by comparing the queue's approximate count, which counts hidden
//! entries too, with the entries it saw and left there: entries it never saw (another scan
//! holds them, or they came after it passed) make it incomplete, and it says so and when to run
//! it again.
//!
//! A requeue puts a fresh trigger on the trigger queue for the entry's record first and removes
//! the entry only after that put succeeded. Dying between the two leaves the trigger in both
//! places (the record runs, and the entry is still there to look at or purge), never in
//! neither.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold_runtime::{PoisonMessage, RecordId, Scope, TriggerMessage};
use leasehold_storage::{StoreErrorKind, StoreResult};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{Operator, OpsError, QueueView, clock};

/// Most entries one peek shows (the service's limit).
pub const PEEK_MAX: usize = 32;
/// How long a scan hides an entry it holds at a time. It hides it again before that ends for as
/// long as it holds it, so a scan that dies leaves its entries hidden at most this long.
pub const SCAN_HIDE: Duration = Duration::from_secs(30);
/// Most entries one scan holds at once (each is hidden again every 15 s while held, one request
/// each: 10,000 is about 670 requests a second, a third of a queue's throughput target).
pub const SCAN_HOLD_MAX: usize = 10_000;
/// Requests hiding held entries again (or putting them back) in flight at once.
const RENEWALS_AT_ONCE: usize = 32;
/// Most of an unreadable entry's body `show` prints, in bytes.
const BODY_SHOWN: usize = 4 * 1024;
/// Most of an entry's reason a listing holds, in bytes (`show` prints it whole).
const REASON_PREVIEW: usize = 512;
/// Most of an unreadable entry's body a listing holds, in bytes.
const BODY_PREVIEW: usize = 256;

/// What [`Operator::poison_list`] shows.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoisonQuery {
    /// At most this many entries (default 32). Up to 32 are peeked, with no side effect; more
    /// are scanned (taken and put back, see the module documentation), at most
    /// [`SCAN_HOLD_MAX`].
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
    /// Why it was given up (in a listing its first 512 bytes, ending ` […]` when cut; `show`
    /// has it whole).
    pub reason: String,
    /// Failed deliveries of the trigger, counting those of the messages it was carried over from.
    pub attempts: u32,
    pub correlation_id: Option<String>,
    /// Whether the entry holds a trigger (and can be requeued); an unreadable message cannot.
    pub is_trigger: bool,
    /// The body of a message that is no trigger (its start, when long: 256 bytes in a listing,
    /// 4 KiB in `show`).
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
    /// Entries in the queue that were not visible to the listing (another reader holds them
    /// hidden: another scan, whose entries come back within 30 s of its end), as far as the
    /// queue's approximate count says; 0 when the listing stopped at its limit.
    pub hidden: u64,
    /// The listing stopped at the most entries one scan holds ([`SCAN_HOLD_MAX`]).
    pub capped: bool,
    /// Entries the scan could not put back (after retries): they come back by themselves when
    /// their hiding ends, within 30 s.
    pub not_put_back: usize,
}

/// Which entries [`Operator::poison_requeue`] and [`Operator::poison_purge`] act on: JSON
/// `{"ids": [..]}`, `{"scope": "..", "recordId": ".."}` (either or both; a record id without
/// a scope is a record of the scope `default`, as everywhere else), or `{"all": true}`.
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

    /// Entries of a scope, or of one record (of `scope`, or of the scope `default` when none
    /// is given).
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

    /// The scope entries must be of: the one named, or `default` for a record named alone.
    fn scope(&self) -> Option<Scope> {
        match (&self.scope, &self.record_id) {
            (Some(scope), _) => Some(scope.clone()),
            (None, Some(_)) => Some(Scope::default()),
            (None, None) => None,
        }
    }

    fn selects(&self, entry: &PoisonEntry) -> bool {
        if self.all {
            return true;
        }
        if !self.ids.is_empty() {
            return self.ids.contains(&entry.id);
        }
        self.scope().is_none_or(|s| entry.scope.as_ref() == Some(&s))
            && self
                .record_id
                .as_ref()
                .is_none_or(|r| entry.record_id.as_ref() == Some(r))
    }

    /// For an entry not selected: its scope, when it is of the record selected but of another
    /// scope (where that record's entries are, if not in the scope selected).
    fn elsewhere<'e>(&self, entry: &'e PoisonEntry) -> Option<&'e Scope> {
        let record = self.record_id.as_ref()?;
        (entry.record_id.as_ref() == Some(record))
            .then_some(entry.scope.as_ref())
            .flatten()
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
    /// A record was named and the scan found no entry of it in the scope selected (the scope
    /// `default` when none was named): `otherScopes` says where its entries are, if anywhere.
    pub record_not_found: bool,
    /// Entries of the record named in other scopes than the one selected, by scope (not acted
    /// on): select one with its scope.
    pub other_scopes: BTreeMap<Scope, usize>,
    pub scanned: usize,
    /// Whether every selected entry was reached: the scan reached the end of the queue, and
    /// the queue holds no entry it did not see (else run it again, after `retryAfter`).
    pub complete: bool,
    /// Entries in the queue the scan did not see: the queue's approximate count (hidden
    /// entries included) beyond the entries the scan left there. Another scan holds them, or
    /// they came after this one passed.
    pub hidden: u64,
    /// When entries hidden by a scan that has ended are visible again: run it again after this.
    #[serde(serialize_with = "clock::serialize_opt")]
    pub retry_after: Option<SystemTime>,
    /// Interrupted (Ctrl-C): it stopped early and put back what it held.
    pub interrupted: bool,
    /// Entries the scan could not put back (after retries): they come back by themselves when
    /// their hiding ends, within 30 s.
    pub not_put_back: usize,
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
    /// As in [`RequeueReport::record_not_found`].
    pub record_not_found: bool,
    /// As in [`RequeueReport::other_scopes`].
    pub other_scopes: BTreeMap<Scope, usize>,
    pub scanned: usize,
    /// As in [`RequeueReport::complete`].
    pub complete: bool,
    /// As in [`RequeueReport::hidden`].
    pub hidden: u64,
    #[serde(serialize_with = "clock::serialize_opt")]
    pub retry_after: Option<SystemTime>,
    pub interrupted: bool,
    pub not_put_back: usize,
    pub message: String,
}

/// What a scan does with an entry it took.
enum Act {
    /// Put it back.
    Keep,
    Requeue,
    Purge,
}

/// How much of an entry's reason and body to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Detail {
    /// What a listing shows (bounded: a listing may hold thousands).
    Preview,
    /// What `show` prints.
    Full,
}

impl Detail {
    fn reason_max(self) -> usize {
        match self {
            Detail::Preview => REASON_PREVIEW,
            Detail::Full => usize::MAX,
        }
    }

    fn body_max(self) -> usize {
        match self {
            Detail::Preview => BODY_PREVIEW,
            Detail::Full => BODY_SHOWN,
        }
    }
}

/// Reads a poison queue message: an entry Leasehold wrote, a bare trigger (the Functions host
/// moves a message there itself after `maxDequeueCount` deliveries), or something else.
fn entry_of(id: String, inserted_at: Option<SystemTime>, body: &str, detail: Detail) -> PoisonEntry {
    let from_trigger = |trigger: TriggerMessage, reason: &str, attempts: u32| PoisonEntry {
        id: id.clone(),
        inserted_at,
        scope: Some(trigger.scope.clone()),
        record_id: Some(trigger.record_id.clone()),
        kind: Some(kind_name(&trigger)),
        reason: cut(reason, detail.reason_max(), false),
        attempts,
        correlation_id: trigger.correlation_id.clone(),
        is_trigger: true,
        body: None,
        trigger: Some(trigger),
    };
    if let Ok(poison) = PoisonMessage::decode(body) {
        let attempts = poison.dequeue_count + poison.trigger.as_ref().map_or(0, |t| t.prior_attempts);
        return match poison.trigger.clone() {
            Some(trigger) => from_trigger(trigger, poison.reason(), attempts),
            None => PoisonEntry {
                id,
                inserted_at,
                scope: None,
                record_id: None,
                kind: None,
                reason: cut(poison.reason(), detail.reason_max(), false),
                attempts,
                correlation_id: None,
                is_trigger: false,
                body: Some(cut(&poison.body(), detail.body_max(), poison.is_cut())),
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
             the handler could not be reached or kept failing without answering",
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
        body: Some(cut(body, detail.body_max(), false)),
        trigger: None,
    }
}

fn kind_name(trigger: &TriggerMessage) -> String {
    serde_json::to_value(trigger.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// At most `max` bytes of `text` (cut at a character boundary), ending ` […]` when cut here or
/// before (`cut_already`).
fn cut(text: &str, max: usize, cut_already: bool) -> String {
    if text.len() <= max {
        return if cut_already {
            format!("{text} […]")
        } else {
            text.to_string()
        };
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} […]", &text[..end])
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

/// An entry a scan holds hidden: what it takes to hide it again, put it back or remove it.
#[derive(Debug)]
struct Held {
    /// The order it was taken in (entries are put back in that order).
    seq: u64,
    receipt: String,
    /// When to hide it again: half its hiding from when it was last hidden.
    renew_at: Instant,
}

/// The entries a scan holds, by id.
#[derive(Debug, Default)]
struct Holding {
    held: HashMap<String, Held>,
    taken: u64,
    /// The earliest `renew_at` (none when nothing is held).
    next_renewal: Option<Instant>,
    /// Entries another reader took while the scan held them (their hiding ran out): still in
    /// the queue, no longer the scan's to put back.
    lost: HashSet<String>,
    /// Renewals that failed (after retries) and will be tried again.
    renew_failures: u64,
}

impl Holding {
    fn len(&self) -> usize {
        self.held.len()
    }

    /// Holds an entry just taken; false if the scan held it already (it came round again: its
    /// hiding ran out before the scan could hide it again), whose receipt is now this one.
    fn take(&mut self, id: &str, receipt: String, renew_at: Instant) -> bool {
        self.next_renewal = Some(self.next_renewal.map_or(renew_at, |at| at.min(renew_at)));
        if let Some(held) = self.held.get_mut(id) {
            held.receipt = receipt;
            held.renew_at = renew_at;
            return false;
        }
        if self.lost.contains(id) {
            // Seen already, then taken by another reader, and back: not new, and not ours
            // either until the end (put back with the rest).
            self.lost.remove(id);
        } else {
            self.taken += 1;
        }
        self.held.insert(
            id.to_string(),
            Held {
                seq: self.taken,
                receipt,
                renew_at,
            },
        );
        true
    }
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
    /// Entries the selection selected.
    selected: usize,
    /// Entries of the record selected in other scopes than the one selected, by scope.
    elsewhere: BTreeMap<Scope, usize>,
    /// The scan stopped before the end of the queue (see [`Operator::scan`]).
    stopped_short: bool,
    /// It stopped because it held [`SCAN_HOLD_MAX`] entries.
    capped: bool,
    /// It stopped because it was interrupted.
    interrupted: bool,
    /// Entries it saw and left in the queue (put back, or held by another reader meanwhile).
    left: u64,
    not_put_back: usize,
}

impl Scan {
    /// Whether a record was named and no entry of it was found in the scope selected.
    fn record_not_found(&self, selection: &PoisonSelection) -> bool {
        selection.record_id.is_some() && self.selected == 0
    }

    /// The clause a report's message says about the record named, if one was: that it has no
    /// entry in the scope selected, and where its entries are (a record named without a scope
    /// is one of the scope `default`, and its entries may be in another).
    fn record_clause(&self, selection: &PoisonSelection) -> String {
        let (Some(record), Some(scope)) = (&selection.record_id, selection.scope()) else {
            return String::new();
        };
        let unnamed = if selection.scope.is_none() {
            " (no scope was named)"
        } else {
            ""
        };
        let elsewhere = self
            .elsewhere
            .iter()
            .map(|(s, n)| format!("{n} in the scope {s}"))
            .collect::<Vec<_>>()
            .join(", ");
        if self.selected > 0 {
            if elsewhere.is_empty() {
                return String::new();
            }
            return format!("; the record {record} also has {elsewhere} (not selected: name that scope)");
        }
        if elsewhere.is_empty() {
            format!("; no entry of the record {record} in the scope {scope}{unnamed}, nor in any other scope")
        } else {
            format!(
                "; no entry of the record {record} in the scope {scope}{unnamed}, but {elsewhere}: name that scope"
            )
        }
    }

    /// The clauses a report's message ends with for how the scan ended.
    fn ending(&self, hold_max: usize, hide: Duration, hidden: Option<u64>) -> String {
        let mut out = String::new();
        if self.interrupted {
            out.push_str("; incomplete: interrupted, it stopped early and put back what it held");
        } else if self.capped {
            out += &format!(
                "; incomplete: it stopped after holding {hold_max} entries it does not act on (the most one scan \
                 holds), so entries behind them were not reached: act on those first, then run it again"
            );
        } else if self.stopped_short {
            out.push_str(
                "; incomplete: the scan stopped before the end of the queue (entries kept coming round): run it again for the rest",
            );
        }
        match hidden {
            Some(0) => {}
            Some(n) => {
                let now = SystemTime::now();
                out += &format!(
                    "; incomplete: {n} hidden, run again after {} (another scan holds them, and a scan's entries \
                     come back within {} of its end; or they came after this one passed)",
                    clock::readable(now + hide, now),
                    clock::span(hide)
                );
            }
            None => out.push_str(
                "; incomplete, maybe: the queue's count could not be read to check for entries this scan did not see",
            ),
        }
        if self.not_put_back > 0 {
            out += &format!(
                "; {} could not be put back (they come back by themselves within {})",
                self.not_put_back,
                clock::span(hide)
            );
        }
        out
    }
}

impl Operator {
    /// The poison entries, oldest first, and the same grouped by record.
    pub async fn poison_list(&self, query: &PoisonQuery) -> Result<PoisonList, OpsError> {
        let limit = query.limit.unwrap_or(PEEK_MAX).max(1);
        let (poison, mut entries, complete, hidden, capped, not_put_back) = if limit <= PEEK_MAX {
            let poison = self.queue_view(&*self.inner.poison).await?;
            let peeked = self
                .inner
                .retry
                .run("peek poison", || self.inner.poison.peek(limit as u32))
                .await
                .map_err(|e| OpsError::storage("peek poison", e))?;
            let shown = peeked.len() as u64;
            // Every visible entry, unless the queue holds more than were shown.
            let complete = peeked.len() < limit || shown >= poison.approximate_messages;
            let hidden = if peeked.len() < limit {
                poison.approximate_messages.saturating_sub(shown)
            } else {
                0
            };
            let entries = peeked
                .into_iter()
                .map(|m| entry_of(m.id, m.inserted_at, &m.body, Detail::Preview))
                .collect::<Vec<_>>();
            (poison, entries, complete, hidden, false, 0)
        } else {
            let scan = self
                .scan(
                    &PoisonSelection::default(),
                    |_| Act::Keep,
                    Some(limit),
                    Detail::Preview,
                    &|_| {},
                )
                .await?;
            if scan.interrupted {
                return Err(interrupted(&scan));
            }
            // Read after the scan (which may have waited for another to end), so the depth is
            // of the queue this listing saw.
            let poison = self.queue_view(&*self.inner.poison).await?;
            let taken = scan.kept.len();
            // Every entry, unless the scan stopped short, kept more than the limit (it keeps
            // whole batches of 32), or the queue holds more than it took.
            let complete = !scan.stopped_short
                && taken <= limit
                && (taken < limit || (taken as u64) >= poison.approximate_messages);
            let hidden = if !scan.stopped_short && taken < limit {
                poison.approximate_messages.saturating_sub(scan.left)
            } else {
                0
            };
            let mut entries = scan.kept;
            // The first `limit` in queue order.
            entries.truncate(limit);
            (poison, entries, complete, hidden, scan.capped, scan.not_put_back)
        };
        entries.sort_by_key(|e| e.inserted_at);
        Ok(PoisonList {
            at: SystemTime::now(),
            poison,
            records: by_record(&entries),
            entries,
            complete,
            hidden,
            capped,
            not_put_back,
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
            return Ok(entry_of(m.id, m.inserted_at, &m.body, Detail::Full));
        }
        let selection = PoisonSelection::ids([id.to_string()]);
        let scan = self
            .scan(&selection, |_| Act::Keep, None, Detail::Full, &|_| {})
            .await?;
        if scan.interrupted {
            return Err(interrupted(&scan));
        }
        if let Some(entry) = scan.kept.into_iter().find(|e| e.id == id) {
            return Ok(entry);
        }
        let mut error = not_in_poison(self.poison_name(), id);
        if let Some(hidden) = self.unseen(scan.left).await.filter(|n| *n > 0) {
            let now = SystemTime::now();
            error = OpsError::NotFound(format!(
                "{error}; {hidden} entries are hidden (another scan holds them): it may be one of them, look again \
                 after {}",
                clock::readable(now + self.inner.scan_hide, now)
            ));
        }
        Err(error)
    }

    /// Puts a fresh trigger on the trigger queue for each selected entry, then removes the
    /// entry. Entries that hold no trigger are skipped (and said so).
    pub async fn poison_requeue(
        &self,
        selection: &PoisonSelection,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<RequeueReport, OpsError> {
        selection.check()?;
        let scan = self
            .scan(selection, |_| Act::Requeue, None, Detail::Preview, progress)
            .await?;
        let not_found = missing(selection, &scan.found);
        let (hidden, complete) = self.coverage(selection, &scan, &not_found).await;
        let message = format!(
            "requeued {} entr{} as fresh triggers{}{}{}",
            scan.requeued.len(),
            if scan.requeued.len() == 1 { "y" } else { "ies" },
            count_clause(scan.skipped.len(), "skipped (no trigger in them)"),
            count_clause(scan.failed.len(), "failed (still in the poison queue)"),
            count_clause(not_found.len(), "not found"),
        ) + &scan.record_clause(selection)
            + &scan.ending(self.inner.scan_hold_max, self.inner.scan_hide, hidden);
        Ok(RequeueReport {
            record_not_found: scan.record_not_found(selection),
            other_scopes: scan.elsewhere,
            complete,
            hidden: hidden.unwrap_or(0),
            retry_after: self.retry_after(hidden),
            interrupted: scan.interrupted,
            not_put_back: scan.not_put_back,
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
        let scan = self
            .scan(selection, |_| Act::Purge, None, Detail::Preview, &|_| {})
            .await?;
        let not_found = missing(selection, &scan.found);
        let (hidden, complete) = self.coverage(selection, &scan, &not_found).await;
        let message = format!(
            "purged {} entr{}{}{}",
            scan.purged.len(),
            if scan.purged.len() == 1 { "y" } else { "ies" },
            count_clause(scan.failed.len(), "failed (still in the poison queue)"),
            count_clause(not_found.len(), "not found"),
        ) + &scan.record_clause(selection)
            + &scan.ending(self.inner.scan_hold_max, self.inner.scan_hide, hidden);
        Ok(PurgeReport {
            record_not_found: scan.record_not_found(selection),
            other_scopes: scan.elsewhere,
            complete,
            hidden: hidden.unwrap_or(0),
            retry_after: self.retry_after(hidden),
            interrupted: scan.interrupted,
            not_put_back: scan.not_put_back,
            purged: scan.purged,
            failed: scan.failed,
            not_found,
            scanned: scan.scanned,
            message,
        })
    }

    /// Entries the queue holds beyond the `left` a scan saw and left there (its approximate
    /// count includes hidden entries); `None` if the count cannot be read.
    async fn unseen(&self, left: u64) -> Option<u64> {
        match self
            .inner
            .retry
            .run("poison queue length", || self.inner.poison.approximate_len())
            .await
        {
            Ok(n) => Some(n.saturating_sub(left)),
            Err(e) => {
                tracing::warn!(error = %e, "poison: could not read the queue's count after a scan");
                None
            }
        }
    }

    /// Entries a requeue or purge did not see (`Some(0)` when that does not matter), and
    /// whether it reached every selected entry.
    async fn coverage(
        &self,
        selection: &PoisonSelection,
        scan: &Scan,
        not_found: &[String],
    ) -> (Option<u64>, bool) {
        // By id: every id found is all there is to reach, whatever else the queue holds.
        if !selection.ids.is_empty() && not_found.is_empty() {
            return (Some(0), !scan.interrupted);
        }
        let hidden = self.unseen(scan.left).await;
        let complete = !scan.stopped_short && !scan.interrupted && hidden == Some(0);
        (hidden, complete)
    }

    fn retry_after(&self, hidden: Option<u64>) -> Option<SystemTime> {
        hidden
            .filter(|n| *n > 0)
            .map(|_| SystemTime::now() + self.inner.scan_hide)
    }

    /// Whether the operator has been told to stop (Ctrl-C on the command line).
    fn interrupted(&self) -> bool {
        self.inner.interrupt.as_ref().is_some_and(|t| t.is_cancelled())
    }

    /// Takes the poison entries 32 at a time (each hidden for the scan's hiding, and hidden
    /// again before that ends while the scan holds it), does `act` with those `selection`
    /// selects (every entry for an empty selection), keeping them in `detail`, and puts the
    /// rest back. Stops at the end of the queue, once `keep_at_most` entries are kept, once every
    /// id selected is found, once it holds [`SCAN_HOLD_MAX`] entries, or when interrupted.
    async fn scan(
        &self,
        selection: &PoisonSelection,
        act: impl Fn(&PoisonEntry) -> Act,
        keep_at_most: Option<usize>,
        detail: Detail,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<Scan, OpsError> {
        // One scan at a time per operator (the dashboard's requests share one): a second scan
        // would hide the entries the first has yet to reach, and the first would stop short of
        // them believing it reached the end.
        let _turn = self.inner.scans.lock().await;
        let poison = &*self.inner.poison;
        let total = poison.approximate_len().await.unwrap_or(0);
        let hide = self.inner.scan_hide;
        let hold_max = self.inner.scan_hold_max;
        // An empty selection (a listing) takes in every entry.
        let everything = selection.check().is_err();
        let by_id = !selection.ids.is_empty();
        let mut scan = Scan::default();
        let mut holding = Holding::default();
        let mut batches = 0u64;
        let max_batches = 4 * (total.div_ceil(PEEK_MAX as u64) + 2) + 100;
        let outcome = async {
            loop {
                if self.interrupted() {
                    scan.interrupted = true;
                    return Ok(());
                }
                self.renew(&mut holding).await;
                let asked = Instant::now();
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
                // The whole batch is held at once: its entries wait their turn hidden again as
                // needed, and an interruption puts back those not reached.
                let mut new = Vec::with_capacity(batch.len());
                let mut again = 0;
                for received in batch {
                    if holding.take(&received.id, received.pop_receipt, asked + hide / 2) {
                        new.push((received.id, received.inserted_at, received.body));
                    } else {
                        again += 1;
                    }
                }
                let fresh = new.len();
                for (id, inserted_at, body) in new {
                    if self.interrupted() {
                        scan.interrupted = true;
                        return Ok(());
                    }
                    scan.scanned += 1;
                    let mut entry = entry_of(id, inserted_at, &body, Detail::Preview);
                    let selected = everything || selection.selects(&entry);
                    if selected {
                        scan.selected += 1;
                    } else if let Some(scope) = selection.elsewhere(&entry) {
                        *scan.elsewhere.entry(scope.clone()).or_default() += 1;
                    }
                    if selected && by_id {
                        scan.found.insert(entry.id.clone());
                    }
                    if selected && detail == Detail::Full {
                        entry = entry_of(entry.id, inserted_at, &body, Detail::Full);
                    }
                    drop(body);
                    match if selected { act(&entry) } else { Act::Keep } {
                        Act::Keep => {
                            if selected {
                                // A listing shows the trigger's fields; the trigger is not kept.
                                entry.trigger = None;
                                scan.kept.push(entry);
                            }
                        }
                        Act::Requeue => self.requeue_one(entry, &mut scan, &mut holding).await,
                        Act::Purge => self.purge_one(entry, &mut scan, &mut holding).await,
                    }
                    progress(&Progress {
                        scanned: scan.scanned,
                        done: scan.requeued.len() + scan.purged.len(),
                        total,
                    });
                    self.renew(&mut holding).await;
                }
                if selection.satisfied(&scan.found)
                    || keep_at_most.is_some_and(|most| scan.kept.len() >= most)
                {
                    return Ok(());
                }
                if holding.len() >= hold_max {
                    scan.stopped_short = true;
                    scan.capped = true;
                    return Ok(());
                }
                // Nothing new (what came round was hidden again by the take, but the queue
                // shows nothing else), or the queue keeps giving far more than it held: stop, and
                // say the scan did not reach the end.
                if (fresh == 0 && again == 0) || batches > max_batches {
                    scan.stopped_short = true;
                    return Ok(());
                }
            }
        }
        .await;
        // Put back what was not acted on, whatever happened above; what cannot be put back
        // comes back by itself when its hiding ends.
        scan.left = (holding.len() + holding.lost.len()) as u64;
        scan.not_put_back = self.put_back(holding).await;
        outcome.map(|()| scan)
    }

    /// Hides again, for the scan's hiding from now, the held entries due for it (several at a
    /// time); drops those another reader took meanwhile. Nothing to do most times it is asked.
    async fn renew(&self, holding: &mut Holding) {
        let now = Instant::now();
        if holding.next_renewal.is_none_or(|at| at > now) {
            return;
        }
        let hide = self.inner.scan_hide;
        let due: Vec<(String, String)> = holding
            .held
            .iter()
            .filter(|(_, h)| h.renew_at <= now)
            .map(|(id, h)| (id.clone(), h.receipt.clone()))
            .collect();
        let poison = &*self.inner.poison;
        let retry = &self.inner.retry;
        let answers: Vec<(String, StoreResult<String>)> = futures::stream::iter(due)
            .map(|(id, receipt)| async move {
                let answer = retry
                    .run("hide a poison entry again", || {
                        poison.update_visibility(&id, &receipt, hide)
                    })
                    .await;
                (id, answer)
            })
            .buffer_unordered(RENEWALS_AT_ONCE)
            .collect()
            .await;
        for (id, answer) in answers {
            match answer {
                Ok(receipt) => {
                    if let Some(h) = holding.held.get_mut(&id) {
                        h.receipt = receipt;
                        h.renew_at = now + hide / 2;
                    }
                }
                // Its hiding ran out and another reader took it (or removed it).
                Err(e) if e.kind() == StoreErrorKind::NotFound => {
                    holding.held.remove(&id);
                    holding.lost.insert(id);
                }
                Err(e) => {
                    holding.renew_failures += 1;
                    tracing::warn!(id, error = %e, hide_seconds = hide.as_secs(),
                        "poison: could not hide a held entry again; trying again in a second (if its hiding ends \
                         first, it comes round again and is hidden again then)");
                    if let Some(h) = holding.held.get_mut(&id) {
                        h.renew_at = Instant::now() + Duration::from_secs(1).min(hide / 4);
                    }
                }
            }
        }
        holding.next_renewal = holding.held.values().map(|h| h.renew_at).min();
    }

    /// Makes the held entries visible again, in the order they were taken (the queue hands out
    /// entries by when they became visible, so the oldest stay first; a batch of 32 goes at
    /// once, batch after batch). Returns how many could not be (after retries).
    async fn put_back(&self, holding: Holding) -> usize {
        let mut back: Vec<(String, Held)> = holding.held.into_iter().collect();
        back.sort_by_key(|(_, h)| h.seq);
        let poison = &*self.inner.poison;
        let retry = &self.inner.retry;
        let mut failed = 0;
        for chunk in back.chunks(RENEWALS_AT_ONCE) {
            let answers = futures::future::join_all(chunk.iter().map(|(id, h)| async move {
                let answer = retry
                    .run("put a poison entry back", || {
                        poison.update_visibility(id, &h.receipt, Duration::ZERO)
                    })
                    .await;
                (id, answer)
            }))
            .await;
            for (id, answer) in answers {
                match answer {
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
                        failed += 1;
                        tracing::warn!(id, error = %e, hide_seconds = self.inner.scan_hide.as_secs(),
                            "poison: could not put an entry back at once; it comes back when its hiding ends");
                    }
                }
            }
        }
        failed
    }

    async fn requeue_one(&self, entry: PoisonEntry, scan: &mut Scan, holding: &mut Holding) {
        let Some(original) = entry.trigger else {
            // Held: put back at the end.
            scan.skipped.push(Skipped {
                id: entry.id,
                why: "the entry holds no trigger (an unreadable message): purge it".into(),
            });
            return;
        };
        // A fresh trigger: a new chain with no attempts behind it, the source's correlation id.
        let mut fresh = TriggerMessage::new(original.scope.clone(), original.record_id.clone());
        fresh.correlation_id = original.correlation_id.clone();
        // A trace of its own, as Start makes for each trigger.
        let span = leasehold_runtime::trace::send(self.queue_name(), &mut fresh, None);
        let body = fresh.encode();
        drop(span);
        let id = entry.id;
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
            return;
        }
        tracing::info!(scope = %fresh.scope, record = %fresh.record_id, poison_id = %id,
            correlation_id = fresh.correlation_id.as_deref().unwrap_or(""),
            "poison: requeued as a fresh trigger");
        self.note(
            &fresh.scope,
            &fresh.record_id,
            leasehold_runtime::HistoryEvent::Requeued,
            "leasehold poison requeue",
            Some(&format!("poison entry {id} requeued on {}", self.queue_name())),
        )
        .await;
        let requeued = Requeued {
            id: id.clone(),
            scope: fresh.scope,
            record_id: fresh.record_id,
            correlation_id: fresh.correlation_id,
        };
        // Only now the entry goes: dying before this leaves it in both places.
        match self.remove_held(&id, holding).await {
            Ok(()) => {}
            Err(Removal::Gone) => scan.failed.push(Skipped {
                id,
                why: format!("requeued; removing the entry then {GONE}"),
            }),
            // Still held: visible again at the end of the scan, and not taken up again before it.
            Err(Removal::Failed(why)) => scan.failed.push(Skipped {
                id,
                why: format!("requeued, but removing the entry failed ({why}); it stays in the poison queue"),
            }),
        }
        scan.requeued.push(requeued);
    }

    async fn purge_one(&self, entry: PoisonEntry, scan: &mut Scan, holding: &mut Holding) {
        let id = entry.id;
        match self.remove_held(&id, holding).await {
            Ok(()) => {
                tracing::info!(poison_id = %id, scope = ?entry.scope.as_ref().map(Scope::as_str),
                    record = ?entry.record_id.as_ref().map(RecordId::as_str), "poison: purged an entry");
                if let (Some(scope), Some(record)) = (&entry.scope, &entry.record_id) {
                    self.note(
                        scope,
                        record,
                        leasehold_runtime::HistoryEvent::Purged,
                        "leasehold poison purge",
                        Some(&format!("poison entry {id} purged")),
                    )
                    .await;
                }
                scan.purged.push(id);
            }
            Err(Removal::Gone) => scan.failed.push(Skipped {
                id,
                why: format!("removing the entry {GONE}"),
            }),
            // Still held: put back at the end.
            Err(Removal::Failed(why)) => scan.failed.push(Skipped { id, why }),
        }
    }

    /// Removes a held entry with the receipt of its latest hiding; it is no longer held unless
    /// storage failed.
    async fn remove_held(&self, id: &str, holding: &mut Holding) -> Result<(), Removal> {
        let Some(receipt) = holding.held.get(id).map(|h| h.receipt.clone()) else {
            return Err(Removal::Gone);
        };
        match self
            .inner
            .retry
            .run("remove poison entry", || self.inner.poison.delete(id, &receipt))
            .await
        {
            Ok(()) => {
                holding.held.remove(id);
                Ok(())
            }
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                holding.held.remove(id);
                Err(Removal::Gone)
            }
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

fn count_clause(n: usize, what: &str) -> String {
    if n == 0 {
        String::new()
    } else {
        format!("; {n} {what}")
    }
}

fn interrupted(scan: &Scan) -> OpsError {
    let failed = if scan.not_put_back > 0 {
        format!(
            "; {} could not be put back (they come back by themselves within {})",
            scan.not_put_back,
            clock::span(SCAN_HIDE)
        )
    } else {
        String::new()
    };
    OpsError::Interrupted(format!(
        "interrupted: put back the {} entries the scan held{failed}",
        scan.left
    ))
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
    use leasehold_runtime::{
        Enqueued, Error, MemoryMarkers, MemoryQueue, Peeked, Received, TriggerKind, TriggerQueue,
    };
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
        /// How long a get takes (of paused time).
        get_takes: Duration,
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
                get_takes: Duration::ZERO,
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
            tokio::time::sleep(self.get_takes).await;
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
            self.inner.set_visibility(id, receipt, body, v).await
        }
        async fn update_visibility(&self, id: &str, receipt: &str, v: Duration) -> StoreResult<String> {
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
            self.inner.update_visibility(id, receipt, v).await
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
        let account = StorageAccount::emulator("127.0.0.1", 1, 2, 3);
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
        let e = entry_of("m1".into(), None, &ours.encode(), Detail::Full);
        assert!(e.is_trigger);
        assert_eq!((e.attempts, e.kind.as_deref()), (7, Some("sweep")));
        assert_eq!(e.reason, "lease lost during the run");
        // The host's own move: a bare trigger.
        let e = entry_of("m2".into(), None, &trigger("r2").encode(), Detail::Full);
        assert!(e.is_trigger && e.reason.contains("maxDequeueCount"));
        assert_eq!(e.attempts, 0);
        // Anything else is shown, not requeued.
        let e = entry_of("m3".into(), None, &"x".repeat(10_000), Detail::Full);
        assert!(!e.is_trigger);
        assert_eq!(e.body.unwrap(), format!("{} […]", "x".repeat(4096)));
        // Cut at a character boundary: 4,096 bytes of 3-byte characters keep 1,365 of them.
        let e = entry_of("m4".into(), None, &"€".repeat(3_000), Detail::Full);
        assert_eq!(e.body.unwrap(), format!("{} […]", "€".repeat(1365)));
        // A listing holds a preview: 256 bytes of a body, 512 of a reason.
        let e = entry_of("m3".into(), None, &"x".repeat(10_000), Detail::Preview);
        assert_eq!(e.body.unwrap(), format!("{} […]", "x".repeat(256)));
        let long = Error::Logic(leasehold_runtime::LogicError::new("y".repeat(5_000)));
        let ours = PoisonMessage::new(t.encode(), Some(t.clone()), &long, 5).encode();
        let e = entry_of("m5".into(), None, &ours, Detail::Preview);
        assert_eq!(e.reason.len(), 512 + " […]".len());
        let e = entry_of("m5".into(), None, &ours, Detail::Full);
        assert!(e.reason.len() > 5_000);
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
        let e = entry_of("m1".into(), None, &trigger("r1").encode(), Detail::Preview);
        assert!(PoisonSelection::all().selects(&e));
        assert!(PoisonSelection::ids(["m1".to_string()]).selects(&e));
        assert!(!PoisonSelection::ids(["m2".to_string()]).selects(&e));
        let scope = Scope::parse("account").ok();
        assert!(PoisonSelection::matching(scope.clone(), None).selects(&e));
        assert!(!PoisonSelection::matching(Scope::parse("contact").ok(), None).selects(&e));
        // A record without a scope is one of the scope "default", as everywhere else.
        assert!(!PoisonSelection::matching(None, RecordId::parse("r1").ok()).selects(&e));
        let in_default = entry_of(
            "m9".into(),
            None,
            &TriggerMessage::new(Scope::default(), RecordId::parse("r1").unwrap()).encode(),
            Detail::Preview,
        );
        assert!(PoisonSelection::matching(None, RecordId::parse("r1").ok()).selects(&in_default));
        assert!(PoisonSelection::matching(scope.clone(), RecordId::parse("r1").ok()).selects(&e));
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
        let mut a = entry_of("m1".into(), Some(t0), &trigger("r1").encode(), Detail::Preview);
        a.reason = "first".into();
        let mut b = entry_of(
            "m2".into(),
            Some(t0 + Duration::from_secs(60)),
            &trigger("r1").encode(),
            Detail::Preview,
        );
        b.reason = "second".into();
        b.attempts = 3;
        let c = entry_of(
            "m3".into(),
            Some(t0 + Duration::from_secs(30)),
            &trigger("r2").encode(),
            Detail::Preview,
        );
        let mut older = entry_of(
            "m0".into(),
            Some(t0 - Duration::from_secs(10)),
            &trigger("r1").encode(),
            Detail::Preview,
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
        assert_eq!(
            (visible.entries.len(), visible.complete, visible.hidden),
            (7, true, 3)
        );
        let scanned = op.poison_list(&PoisonQuery { limit: Some(100) }).await.unwrap();
        assert_eq!(
            (scanned.entries.len(), scanned.complete, scanned.hidden),
            (7, true, 3)
        );
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

    /// A requeue and a purge are written to the record's history, naming the entry; the
    /// requeued trigger is a trace of its own.
    #[tokio::test(start_paused = true)]
    async fn a_requeue_and_a_purge_are_in_the_records_history() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, ["again", "gone"].into_iter().map(String::from)).await;
        let history = Arc::new(leasehold_runtime::MemoryHistory::new());
        let op = operator(queue.clone(), poison.clone()).with_history(Some((
            history.clone() as Arc<dyn leasehold_runtime::HistoryStore>,
            Duration::from_secs(86_400),
        )));
        let list = op.poison_list(&PoisonQuery { limit: Some(10) }).await.unwrap();
        let (again, gone) = (ids_of(&list, "again"), ids_of(&list, "gone"));
        op.poison_requeue(&PoisonSelection::ids(again.clone()), &|_| {})
            .await
            .unwrap();
        op.poison_purge(&PoisonSelection::ids(gone.clone()))
            .await
            .unwrap();
        let read = |record: &str| {
            let history = history.clone();
            let record = record.to_string();
            async move {
                use leasehold_runtime::HistoryStore;
                history
                    .read(
                        &Scope::parse("account").unwrap(),
                        &RecordId::parse(&record).unwrap(),
                        Duration::from_secs(86_400),
                        10,
                    )
                    .await
                    .unwrap()
            }
        };
        let requeued = read("again").await;
        assert_eq!(requeued.len(), 1, "{requeued:?}");
        assert_eq!(requeued[0].event, leasehold_runtime::HistoryEvent::Requeued);
        assert!(
            requeued[0].reason.as_deref().unwrap().contains(&again[0]),
            "{requeued:?}"
        );
        let purged = read("gone").await;
        assert_eq!(purged.len(), 1, "{purged:?}");
        assert_eq!(purged[0].event, leasehold_runtime::HistoryEvent::Purged);
        assert!(
            purged[0].reason.as_deref().unwrap().contains(&gone[0]),
            "{purged:?}"
        );
        let put = queue.inner.get(1, Duration::from_secs(30)).await.unwrap();
        let fresh = TriggerMessage::decode(&put[0].body).unwrap();
        assert!(
            fresh.trace().is_some(),
            "the requeued trigger carries a trace context"
        );
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

    /// A poison queue over a memory queue whose gets take a second: a scan of 2,000 entries
    /// runs over a minute, longer than two hidings.
    async fn deep(entries: usize) -> Arc<Slow> {
        let poison = Arc::new(Slow {
            get_takes: Duration::from_secs(1),
            ..Slow::over(MemoryQueue::new("p", OpCounters::new()))
        });
        fill(&poison, (0..entries).map(|i| format!("r{i:04}"))).await;
        poison
    }

    /// What a scan holds comes back by itself if the scan dies, within its short hiding (30 s)
    /// however deep the queue and however long the scan ran: it hides entries again while it
    /// runs, not for the whole scan up front.
    #[tokio::test(start_paused = true)]
    async fn a_dead_scans_entries_are_back_within_its_short_hiding_however_deep_the_queue() {
        let poison = deep(2000).await;
        let op = operator(slow("q", Duration::ZERO, false), poison.clone()).with_scan_hide(SCAN_HIDE);
        // It dies 45.5 s in, having taken 45 batches, the first of them longer ago than a hiding.
        let died = tokio::time::timeout(
            Duration::from_millis(45_500),
            op.poison_list(&PoisonQuery { limit: Some(5000) }),
        )
        .await;
        assert!(died.is_err());
        let death = Instant::now();
        let held = 2000 - poison.inner.visible_len();
        assert_eq!(held, 45 * 32, "it held all it took until it died");
        let back = poison.inner.all_visible_at().unwrap();
        assert!(
            back <= death + SCAN_HIDE,
            "every entry back within 30 s of the scan's death, not {:?}",
            back - death
        );
        tokio::time::sleep(SCAN_HIDE).await;
        assert_eq!(poison.inner.visible_len(), 2000);
        assert_eq!(poison.inner.bodies().len(), 2000, "nothing lost");
    }

    /// A scan longer than its hiding hides its entries again in time: none comes round, each is
    /// listed once, and all are visible at once at the end.
    #[tokio::test(start_paused = true)]
    async fn a_long_scan_hides_what_it_holds_again_in_time() {
        let poison = deep(2000).await;
        let op = operator(slow("q", Duration::ZERO, false), poison.clone()).with_scan_hide(SCAN_HIDE);
        let started = Instant::now();
        let list = op.poison_list(&PoisonQuery { limit: Some(5000) }).await.unwrap();
        assert!(started.elapsed() > 2 * SCAN_HIDE, "{:?}", started.elapsed());
        let ids: BTreeSet<&str> = list.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!((list.entries.len(), ids.len(), list.complete), (2000, 2000, true));
        assert_eq!(poison.inner.visible_len(), 2000, "all put back at once");
        // Taken once each by the scan (and once more here): none came round again.
        let mut counts = BTreeSet::new();
        loop {
            let batch = poison.inner.get(32, Duration::from_secs(600)).await.unwrap();
            if batch.is_empty() {
                break;
            }
            counts.extend(batch.iter().map(|m| m.dequeue_count));
        }
        assert_eq!(counts, BTreeSet::from([2]));
        // Each entry was hidden again about every 15 s it was held, one request each.
        let updates = poison.inner.counters().snapshot().get(Op::QueueUpdate);
        assert!((2000..12_000).contains(&updates), "{updates} updates");
    }

    /// Interrupted, a scan stops taking entries and puts back what it holds at once: a listing
    /// answers "interrupted", a requeue reports what it did (never a trigger put without its
    /// entry removed), and every other entry is visible again at once.
    #[tokio::test(start_paused = true)]
    async fn an_interrupted_scan_puts_back_what_it_holds_at_once() {
        let poison = deep(500).await;
        let stop = tokio_util::sync::CancellationToken::new();
        let op = operator(slow("q", Duration::ZERO, false), poison.clone())
            .with_scan_hide(SCAN_HIDE)
            .with_interrupt(stop.clone());
        let listing = tokio::spawn({
            let op = op.clone();
            async move { op.poison_list(&PoisonQuery { limit: Some(5000) }).await }
        });
        tokio::time::sleep(Duration::from_millis(5_500)).await;
        assert_eq!(poison.inner.visible_len(), 500 - 5 * 32);
        stop.cancel();
        let Err(answer) = listing.await.unwrap() else {
            panic!("the listing was not interrupted");
        };
        assert!(matches!(answer, OpsError::Interrupted(_)), "{answer}");
        // The five batches taken, and the one whose take was under way: it lets that finish
        // (the entries of a take cut off would stay hidden until their hiding ends).
        assert!(
            answer.to_string().contains("put back the 192 entries"),
            "{answer}"
        );
        assert_eq!(poison.inner.visible_len(), 500, "all visible at once");

        // A requeue whose puts take a second, interrupted in its fifth put: it finishes that
        // entry (put, then remove), then stops.
        let queue = slow("q", Duration::from_secs(1), false);
        let poison = slow("p", Duration::ZERO, false);
        fill(&poison, (0..100).map(|i| format!("r{i:02}"))).await;
        let stop = tokio_util::sync::CancellationToken::new();
        let op = operator(queue.clone(), poison.clone())
            .with_scan_hide(SCAN_HIDE)
            .with_interrupt(stop.clone());
        let requeue = tokio::spawn(async move { op.poison_requeue(&PoisonSelection::all(), &|_| {}).await });
        tokio::time::sleep(Duration::from_millis(4_500)).await;
        stop.cancel();
        let report = requeue.await.unwrap().unwrap();
        assert!(report.interrupted && !report.complete, "{}", report.message);
        assert_eq!(report.requeued.len(), 5, "{}", report.message);
        assert!(
            report.message.contains("incomplete: interrupted"),
            "{}",
            report.message
        );
        assert_eq!(queue.inner.bodies().len(), 5);
        assert_eq!(
            (poison.inner.bodies().len(), poison.inner.visible_len()),
            (95, 95)
        );
    }

    /// A requeue or purge that cannot see every entry (another reader holds some hidden) says
    /// so: incomplete, how many, and when to run it again. Run again then, it gets the rest.
    #[tokio::test(start_paused = true)]
    async fn a_pass_that_cannot_see_every_entry_says_it_is_incomplete() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..100).map(|i| format!("r{i:02}"))).await;
        let op = operator(queue.clone(), poison.clone()).with_scan_hide(SCAN_HIDE);
        // Another scan holds 40 (for 30 s).
        let mut other = poison.inner.get(32, SCAN_HIDE).await.unwrap();
        other.extend(poison.inner.get(8, SCAN_HIDE).await.unwrap());
        let report = op.poison_requeue(&PoisonSelection::all(), &|_| {}).await.unwrap();
        assert_eq!(report.requeued.len(), 60);
        assert!(!report.complete, "{}", report.message);
        assert_eq!(report.hidden, 40);
        assert!(report.retry_after.is_some());
        assert!(
            report.message.contains("incomplete: 40 hidden, run again after "),
            "{}",
            report.message
        );
        // By id, every id found is complete, whatever else is hidden.
        fill(&poison, std::iter::once("x1".to_string())).await;
        let x1 = op.poison_list(&PoisonQuery::default()).await.unwrap().entries[0]
            .id
            .clone();
        let by_id = op.poison_purge(&PoisonSelection::ids([x1])).await.unwrap();
        assert!(by_id.complete && by_id.hidden == 0, "{}", by_id.message);
        // An id not found while entries are hidden: it may be one of them.
        let missing = op
            .poison_purge(&PoisonSelection::ids(["nope".to_string()]))
            .await
            .unwrap();
        assert!(!missing.complete && missing.hidden == 40, "{}", missing.message);
        tokio::time::sleep(SCAN_HIDE).await;
        let report = op.poison_purge(&PoisonSelection::all()).await.unwrap();
        assert_eq!(report.purged.len(), 40);
        assert!(report.complete && report.hidden == 0, "{}", report.message);
        assert!(!report.message.contains("incomplete"), "{}", report.message);
        assert!(poison.inner.bodies().is_empty());
    }

    /// A scan holds at most so many entries: a listing stops there and says so; a requeue of a
    /// scope whose entries are behind more than that says it did not reach them.
    #[tokio::test(start_paused = true)]
    async fn a_scan_holds_at_most_so_many_entries() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..300).map(|i| format!("r{i:03}"))).await;
        let op = operator(queue.clone(), poison.clone()).with_scan_hold_max(100);
        let list = op.poison_list(&PoisonQuery { limit: Some(1000) }).await.unwrap();
        // Whole batches: the fourth takes it to 128.
        assert_eq!(
            (list.entries.len(), list.capped, list.complete),
            (128, true, false)
        );
        assert!(super::super::text::poison_list(&list).contains("the most one scan holds"));
        assert_eq!(poison.inner.visible_len(), 300);
        // The scope "other" is behind 300 entries of "account".
        for i in 0..5 {
            let t = TriggerMessage::new(
                Scope::parse("other").unwrap(),
                RecordId::parse(&format!("o{i}")).unwrap(),
            );
            let error = Error::Logic(leasehold_runtime::LogicError::new("boom"));
            poison
                .inner
                .put(
                    &PoisonMessage::new(t.encode(), Some(t), &error, 5).encode(),
                    Duration::ZERO,
                )
                .await
                .unwrap();
        }
        let report = op
            .poison_requeue(
                &PoisonSelection::matching(Scope::parse("other").ok(), None),
                &|_| {},
            )
            .await
            .unwrap();
        assert!(
            report.requeued.is_empty() && !report.complete,
            "{}",
            report.message
        );
        assert!(
            report
                .message
                .contains("incomplete: it stopped after holding 100 entries"),
            "{}",
            report.message
        );
        assert_eq!(poison.inner.visible_len(), 305);
        // With room to hold them, it gets there.
        let report = operator(queue, poison.clone())
            .poison_requeue(
                &PoisonSelection::matching(Scope::parse("other").ok(), None),
                &|_| {},
            )
            .await
            .unwrap();
        assert_eq!(report.requeued.len(), 5, "{}", report.message);
        assert!(report.complete, "{}", report.message);
    }

    /// Entries that cannot be put back (after retries) are counted and said; they come back by
    /// themselves when their short hiding ends.
    #[tokio::test(start_paused = true)]
    async fn entries_that_cannot_be_put_back_are_said_and_come_back_by_themselves() {
        let poison = Arc::new(Slow {
            put_back_failures: u32::MAX.into(),
            ..Slow::over(MemoryQueue::new("p", OpCounters::new()))
        });
        fill(&poison, (0..40).map(|i| format!("r{i:02}"))).await;
        poison.inner.put("not a trigger", Duration::ZERO).await.unwrap();
        let op = operator(slow("q", Duration::ZERO, false), poison.clone()).with_scan_hide(SCAN_HIDE);
        let list = op.poison_list(&PoisonQuery { limit: Some(100) }).await.unwrap();
        assert_eq!((list.entries.len(), list.not_put_back), (41, 41));
        assert!(
            super::super::text::poison_list(&list).contains("41 could not be put back"),
            "{}",
            super::super::text::poison_list(&list)
        );
        assert!(poison.inner.all_visible_at().unwrap() <= Instant::now() + SCAN_HIDE);
        tokio::time::sleep(SCAN_HIDE).await;
        let report = op.poison_requeue(&PoisonSelection::all(), &|_| {}).await.unwrap();
        assert_eq!((report.requeued.len(), report.not_put_back), (40, 1));
        assert!(
            report.message.contains("1 could not be put back"),
            "{}",
            report.message
        );
    }

    /// What a logic wrote to its stderr reaches the operator's terminal escaped: no escape
    /// sequence, carriage return or bidi override of a reason or body gets through `list` or
    /// `show` as it is; the JSON carries the text exactly.
    #[tokio::test(start_paused = true)]
    async fn reasons_and_bodies_reach_a_terminal_escaped_and_json_exactly() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        let hostile = "boom\u{1b}]0;owned\u{7}\u{1b}[2J\rall fine \u{9b}31m\u{202e}txt.exe";
        let t = trigger("r1");
        let error = Error::Logic(leasehold_runtime::LogicError::new(hostile));
        let entry = PoisonMessage::new(t.encode(), Some(t), &error, 5).encode();
        poison.inner.put(&entry, Duration::ZERO).await.unwrap();
        poison
            .inner
            .put(&format!("junk\u{1b}[31m{hostile}\nsecond line"), Duration::ZERO)
            .await
            .unwrap();
        let op = operator(queue, poison);
        let list = op.poison_list(&PoisonQuery::default()).await.unwrap();
        let text = super::super::text::poison_list(&list);
        let junk = list.entries.iter().find(|e| !e.is_trigger).unwrap();
        let shown = [
            super::super::text::poison_entry(&op.poison_show(&list.entries[0].id).await.unwrap()),
            super::super::text::poison_entry(&op.poison_show(&junk.id).await.unwrap()),
        ];
        for out in [&text, &shown[0], &shown[1]] {
            let raw: Vec<char> = out
                .chars()
                .filter(|c| (c.is_control() && *c != '\n') || *c == '\u{202e}')
                .collect();
            assert!(raw.is_empty(), "{raw:?} in {out}");
            assert!(
                out.contains("boom\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{d}all fine"),
                "{out}"
            );
        }
        assert!(shown[1].contains("junk\\u{1b}[31m"), "{}", shown[1]);
        assert!(
            shown[1].contains("\nsecond line"),
            "show keeps line breaks: {}",
            shown[1]
        );
        // The JSON is exact: it decodes to the very text.
        let json: serde_json::Value = serde_json::from_str(&serde_json::to_string(&list).unwrap()).unwrap();
        let reasons: Vec<&str> = json["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["reason"].as_str().unwrap())
            .collect();
        assert!(
            reasons.contains(&format!("logic failed: {hostile}").as_str()),
            "{reasons:?}"
        );
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

    /// Issue 35: `--record r1` without a scope is r1 of the scope `default`; with r1's entries
    /// in `account` it said "requeued 0 entries" and nothing else. Now the report says the
    /// record has no entry there and where its entries are, for a requeue and a purge; and a
    /// record found in its scope with more entries elsewhere says those too.
    #[tokio::test(start_paused = true)]
    async fn a_record_with_no_entry_in_its_scope_says_where_its_entries_are() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        // r1 twice and r2 of the scope account; r2 of the scope contact.
        fill(&poison, ["r1", "r1", "r2"].into_iter().map(String::from)).await;
        let mut contact = trigger("r2");
        contact.scope = Scope::parse("contact").unwrap();
        let error = Error::Logic(leasehold_runtime::LogicError::new("boom"));
        let entry = PoisonMessage::new(contact.encode(), Some(contact), &error, 5).encode();
        poison.inner.put(&entry, Duration::ZERO).await.unwrap();
        let op = operator(queue.clone(), poison.clone());
        let r1 = || Some(RecordId::parse("r1").unwrap());
        let account = BTreeMap::from([(Scope::parse("account").unwrap(), 2)]);

        let report = op
            .poison_requeue(&PoisonSelection::matching(None, r1()), &|_| {})
            .await
            .unwrap();
        assert!(report.requeued.is_empty() && report.complete, "{report:?}");
        assert!(report.record_not_found);
        assert_eq!(report.other_scopes, account);
        assert_eq!(
            report.message,
            "requeued 0 entries as fresh triggers; no entry of the record r1 in the scope default (no scope was \
             named), but 2 in the scope account: name that scope"
        );
        let report = op
            .poison_purge(&PoisonSelection::matching(None, r1()))
            .await
            .unwrap();
        assert!(report.purged.is_empty() && report.record_not_found, "{report:?}");
        assert_eq!(report.other_scopes, account);
        assert!(
            report
                .message
                .starts_with("purged 0 entries; no entry of the record r1 in the scope default"),
            "{}",
            report.message
        );
        // A scope named: said without "no scope was named".
        let report = op
            .poison_purge(&PoisonSelection::matching(
                Some(Scope::parse("lead").unwrap()),
                r1(),
            ))
            .await
            .unwrap();
        assert_eq!(
            report.message,
            "purged 0 entries; no entry of the record r1 in the scope lead, but 2 in the scope account: name that scope"
        );
        // A record with no entry anywhere.
        let report = op
            .poison_requeue(
                &PoisonSelection::matching(None, Some(RecordId::parse("r9").unwrap())),
                &|_| {},
            )
            .await
            .unwrap();
        assert!(report.record_not_found && report.other_scopes.is_empty());
        assert!(
            report.message.ends_with(
                "no entry of the record r9 in the scope default (no scope was named), nor in any other scope"
            ),
            "{}",
            report.message
        );
        assert_eq!(
            (
                queue.inner.approximate_len().await.unwrap(),
                poison.inner.approximate_len().await.unwrap()
            ),
            (0, 4)
        );
        // Found in its scope, with more elsewhere: requeued, and the rest said.
        let report = op
            .poison_requeue(
                &PoisonSelection::matching(
                    Some(Scope::parse("account").unwrap()),
                    Some(RecordId::parse("r2").unwrap()),
                ),
                &|_| {},
            )
            .await
            .unwrap();
        assert_eq!(report.requeued.len(), 1);
        assert!(!report.record_not_found);
        assert_eq!(
            report.other_scopes,
            BTreeMap::from([(Scope::parse("contact").unwrap(), 1)])
        );
        assert_eq!(
            report.message,
            "requeued 1 entry as fresh triggers; the record r2 also has 1 in the scope contact (not selected: name \
             that scope)"
        );
        // A scope alone, or everything: nothing about a record.
        let report = op.poison_requeue(&PoisonSelection::all(), &|_| {}).await.unwrap();
        assert!(!report.record_not_found && report.other_scopes.is_empty());
        assert_eq!(report.message, "requeued 3 entries as fresh triggers");
    }
}
