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
            parts.push(if s < 60.0 {
                format!("ran {s:.1} s")
            } else {
                format!("ran {}", crate::clock::span(Duration::from_secs_f64(s)))
            });
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

/// Names the run each `coalesced` entry coalesced onto: the run whose `started` came before it
/// and whose end (an entry with its fencing token) had not come yet — whichever instance held
/// it. A coalescing delivery does not know the holder's token (it would cost a read); the
/// history does. `views` are newest first; an entry whose run started before the entries read
/// is left as it is.
pub fn coalesced_onto(views: &mut [HistoryView]) {
    let mut open: Vec<u64> = Vec::new();
    for view in views.iter_mut().rev() {
        match (view.event.as_str(), view.fencing_token) {
            ("started", Some(token)) => open.push(token),
            ("coalesced", None) => {
                if let Some(&token) = open.last() {
                    view.fencing_token = Some(token);
                    if view.reason.is_none() {
                        view.reason = Some(format!("onto the run with token {token}"));
                    }
                }
            }
            (_, Some(token)) => open.retain(|&t| t != token),
            _ => {}
        }
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
        // Bounded: the history is advice beside the lease and markers, and a Table endpoint that
        // does not answer must not hold a status or a record page for its request's time limit.
        let entries = tokio::time::timeout(HISTORY_READ_WAIT, store.read(scope, record, *keep, limit))
            .await
            .map_err(|_| {
                OpsError::Storage(format!(
                    "read the record's history: no answer within {} s",
                    HISTORY_READ_WAIT.as_secs()
                ))
            })?
            .map_err(|e| OpsError::storage("read the record's history", e))?;
        let mut views: Vec<HistoryView> = entries.iter().map(HistoryView::from).collect();
        coalesced_onto(&mut views);
        Ok(views)
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
        let mut entry = HistoryEntry::new(scope.clone(), record.clone(), event);
        entry.instance = instance.to_string();
        if let Some(reason) = reason {
            entry = entry.with_reason(reason);
        }
        self.note_entry(entry).await;
    }

    /// [`note`](Self::note) of an entry the caller made (an enqueue names its lane).
    pub(crate) async fn note_entry(&self, entry: HistoryEntry) {
        let Some((store, _)) = &self.inner.history else {
            return;
        };
        let (scope, record) = (entry.scope.clone(), entry.record.clone());
        // Bounded: an action (an enqueue, "Run it again") is done once its trigger is put; a
        // Table endpoint that does not answer must not hold it for the request's time limit.
        match tokio::time::timeout(NOTE_WAIT, store.append(&[entry])).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(%scope, record = %record, error = %e, "could not write the action to the record's history");
            }
            Err(_) => {
                tracing::warn!(%scope, record = %record, wait_s = NOTE_WAIT.as_secs_f64(),
                    "the action's history entry was not written in time (the Table endpoint did not answer); the action itself is done");
            }
        }
    }
}

/// The longest an operator's action waits for its history entry to be written.
pub const NOTE_WAIT: Duration = Duration::from_secs(1);

/// The longest a record's history is waited for (a status, a record page).
pub const HISTORY_READ_WAIT: Duration = Duration::from_secs(3);

/// The most runs one [`Operator::runs`] answers.
pub const MAX_RUNS_LIMIT: usize = 1000;
/// The runs [`Operator::runs`] answers unless told.
pub const DEFAULT_RUNS_LIMIT: usize = 100;

/// What [`Operator::runs`] lists: runs that ended within `window` before now, of `scope` (every
/// scope when `None`), with one of `outcomes` (every outcome that ends a run when empty).
#[derive(Debug, Clone)]
pub struct RunQuery {
    pub scope: Option<Scope>,
    /// Outcome names (`completed`, `failed`, …): each must be one that ends a run.
    pub outcomes: Vec<String>,
    pub window: Duration,
    /// 1 to [`MAX_RUNS_LIMIT`].
    pub limit: usize,
}

impl Default for RunQuery {
    fn default() -> Self {
        Self {
            scope: None,
            outcomes: Vec::new(),
            window: Duration::from_secs(3600),
            limit: DEFAULT_RUNS_LIMIT,
        }
    }
}

/// One run as the run list shows it: its record and the entry that ended it (its outcome, run
/// time, token, instance, reason).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunView {
    pub scope: Scope,
    pub record_id: RecordId,
    #[serde(flatten)]
    pub entry: HistoryView,
}

impl RunView {
    /// One line a person reads: the record, then the entry's line.
    pub fn line(&self) -> String {
        format!("{}/{}  {}", self.scope, self.record_id, self.entry.line())
    }
}

/// The deployment's recent runs, newest first.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunList {
    #[serde(serialize_with = "crate::clock::serialize")]
    pub at: SystemTime,
    /// The window read: from `since` to `at`.
    #[serde(serialize_with = "crate::clock::serialize")]
    pub since: SystemTime,
    pub runs: Vec<RunView>,
    /// The read stopped at its bound before the whole window was read: runs may be missing,
    /// newer ones among them (a narrower window or a scope reads less).
    pub partial: bool,
    /// Stored items read (history table entities).
    pub scanned: usize,
    /// The outcomes listed.
    pub outcomes: Vec<String>,
}

/// Every outcome that ends a run, by name.
pub fn run_outcomes() -> Vec<&'static str> {
    leasehold_runtime::OutcomeLabel::ALL
        .into_iter()
        .map(HistoryEvent::Outcome)
        .filter(|e| e.ends_a_run())
        .map(HistoryEvent::as_str)
        .collect()
}

/// A window of time as the run list takes it: a whole number of seconds, or with a unit
/// (`90s`, `15m`, `1h`, `24h`, `7d`).
pub fn parse_window(text: &str) -> Result<Duration, OpsError> {
    let text = text.trim();
    let bad = || {
        OpsError::BadRequest(format!(
            "the window must be a whole number of seconds or one with a unit (15m, 1h, 24h, 7d), not {text:?}"
        ))
    };
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    let window = Duration::from_secs(n.checked_mul(seconds).ok_or_else(bad)?);
    if window.is_zero() {
        return Err(OpsError::BadRequest(format!(
            "the window must be longer than 0, not {text:?}"
        )));
    }
    Ok(window)
}

impl Operator {
    /// The runs of every record (or of `query.scope`'s) that ended within `query.window`,
    /// newest first, at most `query.limit`: from the history's tables, a query across
    /// records bounded in requests, entities and time ([`leasehold_runtime::TableHistory`]'s
    /// `recent`), `partial` when it stopped at its bound.
    pub async fn runs(&self, query: &RunQuery) -> Result<RunList, OpsError> {
        if !(1..=MAX_RUNS_LIMIT).contains(&query.limit) {
            return Err(OpsError::BadRequest(format!(
                "the limit must be 1–{MAX_RUNS_LIMIT}, not {}",
                query.limit
            )));
        }
        let ends: Vec<&str> = run_outcomes();
        let mut events = Vec::new();
        for name in &query.outcomes {
            match HistoryEvent::parse(name).filter(|e| e.ends_a_run()) {
                Some(event) => events.push(event),
                None => {
                    return Err(OpsError::BadRequest(format!(
                        "{name:?} is not an outcome that ends a run: one of {}",
                        ends.join(", ")
                    )));
                }
            }
        }
        if events.is_empty() {
            events = ends.iter().filter_map(|n| HistoryEvent::parse(n)).collect();
        }
        let Some((store, keep)) = &self.inner.history else {
            return Err(OpsError::BadRequest(
                "run history is off in this deployment (LEASEHOLD_HISTORY=false)".into(),
            ));
        };
        if query.window > *keep {
            return Err(OpsError::BadRequest(format!(
                "the window ({}) is longer than the history is kept ({}, LEASEHOLD_HISTORY_DAYS)",
                crate::clock::span(query.window),
                crate::clock::span(*keep)
            )));
        }
        let now = SystemTime::now();
        let since = now - query.window;
        let ms = |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let recent = store
            .recent(&leasehold_runtime::RecentQuery {
                since_ms: ms(since),
                until_ms: ms(now),
                scope: query.scope.clone(),
                events: events.clone(),
                limit: query.limit,
            })
            .await
            .map_err(|e| OpsError::storage("read the run history", e))?;
        Ok(RunList {
            at: now,
            since,
            runs: recent
                .entries
                .iter()
                .map(|e| RunView {
                    scope: e.scope.clone(),
                    record_id: e.record.clone(),
                    entry: HistoryView::from(e),
                })
                .collect(),
            partial: recent.partial,
            scanned: recent.scanned,
            outcomes: events.iter().map(|e| e.as_str().to_string()).collect(),
        })
    }
}

/// What a record is doing now, in one line, for every cause: from its lease and markers (as
/// storage holds them, whichever instance set them) and its newest history entries.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordState {
    /// `running`, `waiting`, `deferred`, `paused`, `queued`, `poisoned` or `idle`.
    pub state: &'static str,
    /// Until when, where it applies (RFC 3339): a wait's latest end, a run put off, a pause, a
    /// retry.
    #[serde(serialize_with = "crate::clock::serialize_opt")]
    pub until: Option<SystemTime>,
    /// The line a person reads.
    pub reason: String,
}

impl RecordState {
    /// The state of the record `view` shows, whose history (newest first, possibly empty)
    /// is `history`, at `now`; `queue` is its lane's queue, if known.
    pub fn of(
        view: &crate::RecordView,
        history: &[HistoryView],
        queue: Option<&crate::QueueView>,
        now: SystemTime,
    ) -> Self {
        let newest = history.first();
        // The lane's queue and its depth, the lane named when the newest entry says which.
        let lane = newest
            .and_then(|e| e.lane.as_deref())
            .map(|l| format!("the {l} lane's queue "))
            .unwrap_or_default();
        let ahead = |q: Option<&crate::QueueView>| {
            q.map(|q| format!(" (about {} messages in {lane}{})", q.approximate_messages, q.name))
                .unwrap_or_default()
        };
        let later = |e: &HistoryView| e.until.filter(|u| *u > now);
        if view.held {
            let since = view
                .since
                .map(|s| format!(" since {}", crate::clock::rfc3339(s)))
                .unwrap_or_default();
            let holder = view
                .holder
                .as_deref()
                .unwrap_or("a holder (its name is written at its lease's first renewal)");
            let token = if view.generation > 0 {
                format!(", token {}", view.generation)
            } else {
                String::new()
            };
            let pending = if view.retrigger_pending {
                "; triggers came during it: it runs once more after"
            } else {
                ""
            };
            return Self {
                state: "running",
                until: None,
                reason: format!("running on {holder}{since}{token}{pending}"),
            };
        }
        if view.waiting {
            let until = history.iter().find(|e| e.event == "waiting").and_then(later);
            return Self {
                state: "waiting",
                until,
                reason: match until {
                    Some(u) => format!(
                        "waiting for its burst of triggers to end (it looks again at {} at the latest)",
                        crate::clock::rfc3339(u)
                    ),
                    None => "waiting for its burst of triggers to end".into(),
                },
            };
        }
        let Some(newest) = newest else {
            let queued_somewhere = queue.is_some_and(|q| q.approximate_messages > 0);
            return if view.retrigger_pending {
                Self {
                    state: "queued",
                    until: None,
                    reason: format!("a retrigger is pending{}", ahead(queue)),
                }
            } else if queued_somewhere {
                // A trigger put in the last seconds is in the history only once delivered (and
                // its entry gathered, 2 s at most): with messages queued, it may be one of them.
                Self {
                    state: "unknown",
                    until: None,
                    reason: format!(
                        "no history within the days kept, and messages are queued{}: a trigger put \
                         in the last few seconds is written to the history once it is delivered",
                        ahead(queue)
                    ),
                }
            } else {
                Self {
                    state: "idle",
                    until: None,
                    reason: "idle: no history within the days kept, and nothing queued".into(),
                }
            };
        };
        let at = crate::clock::rfc3339(newest.time);
        let until = crate::clock::rfc3339(newest.until.unwrap_or(now));
        let why = newest
            .reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default();
        match newest.event.as_str() {
            "deferred" if later(newest).is_some() => Self {
                state: "deferred",
                until: newest.until,
                reason: format!("put off by its logic until {until}{why}"),
            },
            "paused" if later(newest).is_some() => Self {
                state: "paused",
                until: newest.until,
                reason: format!(
                    "held by budget {}'s pause until {until} (see leasehold budget status)",
                    newest.budget.as_deref().unwrap_or("?"),
                ),
            },
            "at_limit" if later(newest).is_some() => Self {
                state: "queued",
                until: newest.until,
                reason: format!(
                    "waiting for a slot of budget {}'s limit (its runs are all under way): its \
                     trigger comes back at {until}",
                    newest.budget.as_deref().unwrap_or("?"),
                ),
            },
            // Its `until` has passed: its trigger is visible again and has not run yet (its
            // delivery would have written an entry since, its run a start).
            "paused" | "at_limit" | "deferred" | "waiting" | "failed" | "lease_lost" | "rechecked"
                if newest.until.is_some() && later(newest).is_none() =>
            {
                Self {
                    state: "queued",
                    until: newest.until,
                    reason: format!(
                        "{} at {at}; due since {until}: its trigger is on its way{}",
                        newest.event,
                        ahead(queue)
                    ),
                }
            }
            "waiting" if later(newest).is_some() => Self {
                state: "waiting",
                until: newest.until,
                reason: format!("waiting for its burst of triggers to end (it looks again at {until})"),
            },
            "failed" | "lease_lost" | "rechecked" if later(newest).is_some() => Self {
                state: "queued",
                until: newest.until,
                reason: format!("{} at {at}; it comes back at {until}{why}", newest.event),
            },
            "poisoned" => {
                // The give-up says how many deliveries failed; the failure itself is in the
                // entry of the last one that failed before it.
                let failure = history[1..]
                    .iter()
                    .take_while(|e| e.event != "poisoned")
                    .find(|e| e.event == "failed" || e.event == "lease_lost")
                    .and_then(|e| e.reason.as_deref())
                    .filter(|r| !newest.reason.as_deref().is_some_and(|n| n.contains(r)))
                    .map(|r| format!("; the last failure: {r}"))
                    .unwrap_or_default();
                Self {
                    state: "poisoned",
                    until: None,
                    reason: format!("given up at {at}{why}{failure} (leasehold poison list)"),
                }
            }
            // A trigger that coalesced with no run under way (the lease free, nothing pending):
            // a sweep after a give-up that found no trigger owed, which ends the give-ups. The
            // record is as its give-up left it, if one came before.
            "coalesced" if !view.retrigger_pending && poisoned_before(history).is_some() => {
                let from = poisoned_before(history).expect("checked");
                let mut state = Self::of(view, &history[from..], queue, now);
                state.reason = format!("{}; its sweep at {at} found no trigger owed", state.reason);
                state
            }
            "enqueued" | "requeued" | "coalesced" | "debounced" | "retriggered" | "failed" | "lease_lost" => {
                Self {
                    state: "queued",
                    until: None,
                    reason: format!(
                        "{} at {at}; a trigger is on its way{}",
                        newest.event,
                        ahead(queue)
                    ),
                }
            }
            _ if view.retrigger_pending => Self {
                state: "queued",
                until: None,
                reason: format!("a retrigger is pending{}", ahead(queue)),
            },
            // A run whose start is written but not its end, with the lease free: it ended in
            // the last couple of seconds (its end is written 2 s after at most), or its holder
            // died (its trigger comes back once the lease has expired and runs again).
            _ if newest.event == "started" => Self {
                state: "idle",
                until: None,
                reason: format!(
                    "idle; last: a run started at {at}{} on {} and its lease is free: it has just \
                     ended (its outcome is written within seconds), or its holder died (its trigger \
                     comes back and runs again)",
                    newest
                        .fencing_token
                        .map(|t| format!(" (token {t})"))
                        .unwrap_or_default(),
                    newest.instance
                ),
            },
            _ => {
                let ran = newest
                    .run_seconds
                    .map(|s| format!(" (ran {s:.1} s)"))
                    .unwrap_or_default();
                Self {
                    state: "idle",
                    until: None,
                    reason: format!("idle; last: {} at {at}{ran}{why}", newest.event),
                }
            }
        }
    }
}

impl RecordState {
    /// This state, knowing that the history could not be read (`why`): a state that came from
    /// the history's silence (idle, or not known) says so, and why, instead of "idle".
    pub fn history_unreadable(self, why: &str) -> Self {
        if matches!(self.state, "idle" | "unknown") {
            Self {
                state: "unknown",
                until: None,
                reason: format!(
                    "the run history could not be read ({why}); the lease is free and no retrigger is pending"
                ),
            }
        } else {
            self
        }
    }
}

/// Where the give-up entry is that the newest entries follow with no run since, if any:
/// `coalesced` and `debounced` may follow it, a start or another end of a run may not.
fn poisoned_before(history: &[HistoryView]) -> Option<usize> {
    history
        .iter()
        .enumerate()
        .skip(1)
        .take_while(|(_, e)| matches!(e.event.as_str(), "coalesced" | "debounced" | "poisoned"))
        .find(|(_, e)| e.event == "poisoned")
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A coalesced entry names the run it coalesced onto (by its token), whichever instance
    /// held it: the run started before it and not yet ended; none when no run was open.
    #[test]
    fn a_coalesced_trigger_names_the_run_it_coalesced_onto() {
        let now = SystemTime::now();
        let at = |event: &str, token: Option<u64>| HistoryView {
            fencing_token: token,
            reason: None,
            ..entry(event, None, now)
        };
        // Oldest last, as read.
        let mut views = vec![
            at("coalesced", None),
            at("completed", Some(8)),
            at("coalesced", None),
            at("started", Some(8)),
            at("retriggered", Some(7)),
            at("coalesced", None),
            at("coalesced", None),
            at("started", Some(7)),
            at("coalesced", None),
        ];
        coalesced_onto(&mut views);
        let tokens: Vec<Option<u64>> = views.iter().map(|v| v.fencing_token).collect();
        assert_eq!(
            tokens,
            [
                None,
                Some(8),
                Some(8),
                Some(8),
                Some(7),
                Some(7),
                Some(7),
                Some(7),
                None
            ]
        );
        assert_eq!(views[2].reason.as_deref(), Some("onto the run with token 8"));
        assert_eq!(views[0].reason, None);
        // A holder died mid-run (its start has no end) and the next run started: a trigger
        // then coalesced onto the newest run, not the dead one (issue 44, item 7: naming the
        // oldest open run went unseen).
        let mut views = vec![
            at("coalesced", None),
            at("started", Some(4)),
            at("started", Some(3)),
        ];
        coalesced_onto(&mut views);
        assert_eq!(views[0].fencing_token, Some(4));
        assert_eq!(views[0].reason.as_deref(), Some("onto the run with token 4"));
    }

    #[test]
    fn windows_are_read_with_their_unit_and_bad_ones_named() {
        for (text, secs) in [
            ("900", 900),
            ("90s", 90),
            ("15m", 900),
            ("1h", 3600),
            ("7d", 604_800),
        ] {
            assert_eq!(parse_window(text).unwrap(), Duration::from_secs(secs), "{text}");
        }
        for bad in ["", "h", "1w", "-5m", "0", "1.5h", "99999999999999999999d"] {
            let e = parse_window(bad).unwrap_err();
            assert_eq!(e.status(), 400, "{bad}");
            assert!(e.to_string().contains("window"), "{bad}: {e}");
        }
    }

    fn operator(history: Option<Arc<leasehold_runtime::MemoryHistory>>) -> Operator {
        use leasehold_lock::{LeaseLock, LeaseOptions, memory::MemoryStore};
        use leasehold_runtime::{MemoryMarkers, MemoryQueue};
        use leasehold_storage::{OpCounters, StorageAccount, azure::BlobContainer};
        let lock = LeaseLock::new(Arc::new(MemoryStore::new()), LeaseOptions::default()).unwrap();
        let account = StorageAccount::emulator("127.0.0.1", 1, 2, 3);
        Operator::from_parts(
            Arc::new(MemoryQueue::new("q", OpCounters::new())),
            Arc::new(MemoryQueue::new("q-poison", OpCounters::new())),
            lock,
            Arc::new(MemoryMarkers::new()),
            BlobContainer::new(&account, "unused", OpCounters::new()),
            OpCounters::new(),
        )
        .with_history(history.map(|h| {
            (
                h as Arc<dyn leasehold_runtime::HistoryStore>,
                Duration::from_secs(86_400),
            )
        }))
    }

    /// The run list: outcomes that end a run, newest first, of a scope and outcome when asked;
    /// bad outcomes, limits and windows longer than the history is kept are refused by name.
    #[tokio::test]
    async fn runs_are_the_outcomes_that_end_a_run_newest_first() {
        use leasehold_runtime::{HistoryStore, OutcomeLabel};
        let store = Arc::new(leasehold_runtime::MemoryHistory::new());
        let now = UNIX_EPOCH.elapsed().unwrap().as_millis() as u64;
        let at = |scope: &str, record: &str, event, ago_ms: u64| {
            let mut e = HistoryEntry::new(
                Scope::parse(scope).unwrap(),
                RecordId::parse(record).unwrap(),
                event,
            );
            e.time_ms = now - ago_ms;
            e
        };
        let outcome = HistoryEvent::Outcome;
        store
            .append(&[
                at("account", "1", HistoryEvent::Started, 9_000),
                at("account", "1", outcome(OutcomeLabel::Coalesced), 8_500),
                at("account", "1", outcome(OutcomeLabel::Retriggered), 8_000),
            ])
            .await
            .unwrap();
        store
            .append(&[at("account", "1", outcome(OutcomeLabel::Completed), 4_000)])
            .await
            .unwrap();
        store
            .append(&[at("contact", "2", outcome(OutcomeLabel::Failed), 2_000)])
            .await
            .unwrap();
        store
            .append(&[at("account", "old", outcome(OutcomeLabel::Completed), 7_200_000)])
            .await
            .unwrap();
        let op = operator(Some(store));
        let list = |query: RunQuery| {
            let op = op.clone();
            async move { op.runs(&query).await }
        };
        let names = |l: &RunList| -> Vec<String> {
            l.runs
                .iter()
                .map(|r| format!("{}/{} {}", r.scope, r.record_id, r.entry.event))
                .collect()
        };
        let all = list(RunQuery::default()).await.unwrap();
        assert_eq!(
            names(&all),
            ["contact/2 failed", "account/1 completed", "account/1 retriggered"],
            "runs of the last hour, newest first, no start or coalesced trigger"
        );
        assert!(!all.partial);
        let scoped = list(RunQuery {
            scope: Some(Scope::parse("account").unwrap()),
            outcomes: vec!["completed".into()],
            ..RunQuery::default()
        })
        .await
        .unwrap();
        assert_eq!(names(&scoped), ["account/1 completed"]);
        let day = list(RunQuery {
            window: Duration::from_secs(86_400),
            limit: 10,
            ..RunQuery::default()
        })
        .await
        .unwrap();
        assert_eq!(day.runs.len(), 4, "the older run in a day's window");
        for (query, names) in [
            (
                RunQuery {
                    outcomes: vec!["started".into()],
                    ..RunQuery::default()
                },
                "not an outcome that ends a run",
            ),
            (
                RunQuery {
                    limit: 0,
                    ..RunQuery::default()
                },
                "limit",
            ),
            (
                RunQuery {
                    window: Duration::from_secs(2 * 86_400),
                    ..RunQuery::default()
                },
                "longer than the history is kept",
            ),
        ] {
            let e = list(query).await.unwrap_err();
            assert_eq!(e.status(), 400, "{e}");
            assert!(e.to_string().contains(names), "{e}");
        }
        let off = operator(None).runs(&RunQuery::default()).await.unwrap_err();
        assert!(off.to_string().contains("history is off"), "{off}");
    }

    #[test]
    fn the_outcomes_that_end_a_run() {
        assert_eq!(
            run_outcomes(),
            [
                "completed",
                "retriggered",
                "failed",
                "lease_lost",
                "poisoned",
                "deferred",
                "superseded"
            ]
        );
    }

    fn view(held: bool, waiting: bool, pending: bool) -> crate::RecordView {
        crate::RecordView {
            scope: Scope::parse("account").unwrap(),
            record_id: RecordId::parse("1").unwrap(),
            held,
            lease_state: None,
            holder: held.then(|| "host-a:42".to_string()),
            since: held.then(SystemTime::now),
            since_age_seconds: None,
            generation: if held { 7 } else { 0 },
            retrigger_pending: pending,
            waiting,
            sharers: Vec::new(),
            superseded_in_a_row: None,
            at: SystemTime::now(),
        }
    }

    fn entry(event: &str, until_in: Option<i64>, now: SystemTime) -> HistoryView {
        HistoryView {
            time: now - Duration::from_secs(5),
            event: event.into(),
            attempt: 1,
            fencing_token: Some(3),
            instance: "host-b:7".into(),
            lane: Some("high".into()),
            budget: Some("default".into()),
            run_seconds: Some(1.5),
            until: until_in.map(|s| {
                if s >= 0 {
                    now + Duration::from_secs(s as u64)
                } else {
                    now - Duration::from_secs((-s) as u64)
                }
            }),
            correlation_id: None,
            trace_id: None,
            reason: Some("429 Too Many Requests".into()),
        }
    }

    /// Each cause has its state, from storage's view of the lease and markers first, then the
    /// newest history entry; a past `until` is no longer a state.
    #[test]
    fn every_cause_has_its_state() {
        let now = SystemTime::now();
        let state = |v: &crate::RecordView, h: &[HistoryView]| RecordState::of(v, h, None, now);
        let running = state(&view(true, false, true), &[]);
        assert_eq!(running.state, "running");
        assert!(
            running.reason.contains("host-a:42") && running.reason.contains("token 7"),
            "{running:?}"
        );
        assert!(running.reason.contains("once more"), "{running:?}");
        let waiting = state(&view(false, true, false), &[entry("waiting", Some(30), now)]);
        assert_eq!((waiting.state, waiting.until.is_some()), ("waiting", true));
        for (event, expected) in [
            ("deferred", "deferred"),
            ("paused", "paused"),
            ("waiting", "waiting"),
            ("failed", "queued"),
            ("rechecked", "queued"),
        ] {
            let s = state(&view(false, false, false), &[entry(event, Some(60), now)]);
            assert_eq!(s.state, expected, "{event}: {s:?}");
            assert!(s.until.is_some(), "{event}");
        }
        let paused = state(&view(false, false, false), &[entry("paused", Some(60), now)]);
        assert!(paused.reason.contains("budget default"), "{paused:?}");
        let deferred = state(&view(false, false, false), &[entry("deferred", Some(60), now)]);
        assert!(deferred.reason.contains("429"), "{deferred:?}");
        // Over: no longer deferred, paused or waiting, but not idle either: its trigger is
        // visible again and has not run (issue 44: it said idle, for up to the whole drain).
        for event in ["deferred", "paused", "waiting", "at_limit", "failed"] {
            let over = state(&view(false, false, false), &[entry(event, Some(-1), now)]);
            assert_eq!(over.state, "queued", "{event}: {over:?}");
            assert!(over.reason.contains("due since"), "{event}: {over:?}");
        }
        let limited = state(&view(false, false, false), &[entry("at_limit", Some(60), now)]);
        assert_eq!(limited.state, "queued", "{limited:?}");
        assert!(
            limited.reason.contains("budget default's limit") && !limited.reason.contains("pause"),
            "not a pause: {limited:?}"
        );
        // A sweep after a give-up that found no trigger owed: poisoned and idle, not queued
        // (issue 44: "a trigger is on its way (about 0 messages)", for good).
        let sweep = state(
            &view(false, false, false),
            &[entry("coalesced", None, now), entry("poisoned", None, now)],
        );
        assert_eq!(sweep.state, "poisoned", "{sweep:?}");
        assert!(sweep.reason.contains("no trigger owed"), "{sweep:?}");
        // A coalesced trigger after runs: still on its way.
        assert_eq!(
            state(
                &view(false, false, false),
                &[entry("coalesced", None, now), entry("completed", None, now)]
            )
            .state,
            "queued"
        );
        // No history yet, with messages queued: not said idle.
        let unknown = RecordState::of(
            &view(false, false, false),
            &[],
            Some(&crate::QueueView {
                name: "q".into(),
                approximate_messages: 3,
                oldest_visible_at: None,
                oldest_visible_age_seconds: None,
            }),
            now,
        );
        assert_eq!(unknown.state, "unknown", "{unknown:?}");
        assert_eq!(
            state(&view(false, false, false), &[entry("poisoned", None, now)]).state,
            "poisoned"
        );
        // A give-up names the failure of the last delivery that failed before it.
        let mut gave_up = entry("poisoned", None, now);
        gave_up.reason = Some("gave up after 2 deliveries (max 2)".into());
        let mut failed = entry("failed", None, now);
        failed.reason = Some("the logic command exited with code 3: refused".into());
        let poisoned = state(&view(false, false, false), &[gave_up, failed]);
        assert!(
            poisoned.reason.contains("gave up after 2")
                && poisoned
                    .reason
                    .contains("the last failure: the logic command exited with code 3: refused"),
            "{poisoned:?}"
        );
        // A queued trigger names its lane's queue.
        let mut enqueued = entry("enqueued", None, now);
        enqueued.lane = Some("low".into());
        let low = crate::QueueView {
            name: "q-low".into(),
            approximate_messages: 2,
            oldest_visible_at: None,
            oldest_visible_age_seconds: None,
        };
        let queued = RecordState::of(&view(false, false, false), &[enqueued], Some(&low), now);
        assert!(
            queued
                .reason
                .contains("about 2 messages in the low lane's queue q-low"),
            "{queued:?}"
        );
        assert_eq!(
            state(&view(false, false, false), &[entry("enqueued", None, now)]).state,
            "queued"
        );
        let idle = state(&view(false, false, false), &[entry("completed", None, now)]);
        assert_eq!(idle.state, "idle");
        assert!(
            idle.reason.contains("completed") && idle.reason.contains("ran"),
            "{idle:?}"
        );
        assert_eq!(state(&view(false, false, true), &[]).state, "queued");
        assert_eq!(state(&view(false, false, false), &[]).state, "idle");
        // A start with no end and the lease free: ended just now, or its holder died.
        let unended = state(&view(false, false, false), &[entry("started", None, now)]);
        assert_eq!(unended.state, "idle");
        assert!(
            unended.reason.contains("token 3") && unended.reason.contains("holder died"),
            "{unended:?}"
        );
    }
}
