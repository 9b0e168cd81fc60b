//! The trigger message: JSON naming scope and record, base64-encoded on the wire (the Functions
//! queue trigger's default `messageEncoding`), so both modes read what either wrote.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use leasehold_lock::LockKey;
use serde::{Deserialize, Serialize};

use crate::record::{InvalidName, RecordId, Scope, record_key};
use crate::trace::TraceContext;

/// Why a message was enqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TriggerKind {
    /// From Start (or `leasehold enqueue`): an event for the record.
    #[default]
    Trigger,
    /// From a holder that found the retrigger marker set after its run.
    Retrigger,
    /// From a redelivered trigger that found the lease held: look again once a dead holder's
    /// lease must have expired.
    Recheck,
    /// Functions mode: put (hidden) before a delivery touches the lease and deleted when it
    /// ends; it surfaces only if the delivery's host died (or fell silent) on the way, and then
    /// stands in for it. A failed delivery turns it into its retry.
    Watchdog,
    /// Put when a trigger is given up (poisoned): once the lease is free, run if the retrigger
    /// marker is set, so triggers that coalesced onto a holder of the poisoned trigger are still
    /// honoured.
    Sweep,
}

impl TriggerKind {
    /// Whether a message of this kind carries a dead holder's duty. Such a message never takes
    /// a held lease on trust (the holder may be the dead one it stands in for): it looks again
    /// once that lease must have expired.
    pub fn is_carrier(self) -> bool {
        matches!(
            self,
            TriggerKind::Recheck | TriggerKind::Watchdog | TriggerKind::Sweep
        )
    }
}

/// A trigger for one record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TriggerMessage {
    pub scope: Scope,
    pub record_id: RecordId,
    #[serde(default)]
    pub kind: TriggerKind,
    /// Failed deliveries of this trigger in earlier messages it was carried over from (a recheck
    /// or a watchdog carries its origin's count), so a trigger cannot dodge the poison limit by
    /// being copied. A delivery that only looked (and found a run in progress) does not count.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prior_attempts: u32,
    /// How many times this trigger's chain was given up (a sweep carries its origin's count + 1,
    /// its rechecks, watchdogs and retries keep it; a retrigger starts a new chain at 0): the
    /// sweep of a chain given up twice — a sweep that kept failing — runs only if the marker is
    /// set, so logic that always fails does not cycle through the poison queue for ever.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub given_up: u32,
    /// Correlation id from the source (Dataverse `CorrelationId`, or one Start made up). Start
    /// refuses one over [`MAX_CORRELATION_ID_LEN`] bytes; a longer one in a message another tool
    /// put is cut to that length when read (it only names the event in logs).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "bounded_correlation_id"
    )]
    pub correlation_id: Option<String>,
    /// Deliveries of *this* queue message that ended in a deliberate re-hide rather than a
    /// failure: the standalone consumer turns a deferred delivery's message into its deferral in
    /// place, which raises the message's dequeue count, so the count it had then is kept here and
    /// [`Delivery::attempts`](crate::Delivery::attempts) leaves those deliveries out. 0 in every
    /// new message.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rehides: u32,
    /// The chain's requests to run later so far, when its logic asked
    /// ([`LogicError::run_later`](crate::LogicError::run_later)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deferral: Option<Deferral>,
    /// In a superseding scope: the retry (or deferral) of the run with this fencing token, which
    /// noted itself as pending on the record's lease. Once granted, it runs only if that note
    /// still names it; otherwise a later run has taken its duty over and it stands down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_token: Option<u64>,
    /// In a scope that debounces: this message waits for the record's burst of triggers to end
    /// (it is the *waiter* of the record's wait marker), or stands in for a delivery that may
    /// have created a wait marker and died. See [`crate::RecordRunner`], *Debounce*.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<Wait>,
    /// The W3C context of the span that put this message ([`crate::trace`]): Start's, or the
    /// delivery's that carried the chain on. One that is not valid W3C is dropped when read
    /// (the message still runs; its trace starts afresh).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "valid_traceparent"
    )]
    pub traceparent: Option<String>,
    /// The vendors' `tracestate` that goes with [`traceparent`](Self::traceparent); dropped when
    /// read if over [`crate::trace::MAX_TRACESTATE_LEN`] or malformed.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "valid_tracestate"
    )]
    pub tracestate: Option<String>,
    /// In a retrigger (and the chain it starts): the contexts (`traceparent`s) of the triggers
    /// that coalesced onto the run that put it, which the run it makes links to. At most
    /// [`crate::trace::MAX_LINKS`]; invalid ones are dropped when read.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "valid_links"
    )]
    pub links: Vec<String>,
}

fn valid_traceparent<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    Ok(text.filter(|t| TraceContext::parse(t, None).is_some()))
}

fn valid_tracestate<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    Ok(text.and_then(|t| crate::trace::checked_state(&t)))
}

fn valid_links<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let links = Vec::<String>::deserialize(d)?;
    let mut valid: Vec<String> = links
        .into_iter()
        .filter(|t| TraceContext::parse(t, None).is_some())
        .collect();
    let extra = valid.len().saturating_sub(crate::trace::MAX_LINKS);
    valid.drain(..extra);
    Ok(valid)
}

/// How far a waiter has got ([`TriggerMessage::wait`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Wait {
    /// The wait marker's ETag when the waiter last looked (`None`: not known), so it can tell
    /// whether a trigger joined since. An ETag is short; a longer one in a message another tool
    /// put is cut when read (it then only fails to match).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "bounded_etag"
    )]
    pub etag: Option<String>,
    /// How long it has waited so far, in milliseconds: the sum of its own delays, not a clock
    /// reading, so the longest wait holds whatever the workers' clocks say.
    #[serde(default)]
    pub waited_ms: u64,
    /// Whether it owes a run even if it finds no wait marker: a delete of it whose first answer
    /// was lost may have consumed one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub owed: bool,
}

/// Longest wait marker ETag a message carries, in bytes (Azure's are about 20).
const MAX_ETAG_LEN: usize = 128;

fn bounded_etag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let tag = Option::<String>::deserialize(d)?;
    Ok(tag.map(|t| truncate_to(&t, MAX_ETAG_LEN).to_string()))
}

/// How long a trigger's chain has been put off because its logic asked to be run later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Deferral {
    /// Delay granted so far, in milliseconds: the sum of the delays, not a clock reading, so
    /// the bound holds whatever the workers' clocks say.
    pub total_ms: u64,
    /// Requests to run later granted so far.
    pub hops: u32,
    /// Drawn at the chain's first deferral, to follow it in logs.
    pub id: u64,
    /// Whether this message is the deferral itself, as its holder wrote it after releasing the
    /// lease, and has not found the lease held since: it then stands in for no dead holder, and
    /// its run draws on its downstream budget as a trigger's does
    /// ([`Delivery::may_stand_in`](crate::Delivery::may_stand_in)). A look again made from it
    /// (it found the lease held) is not; nor is a message written before this field existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub released: bool,
    /// Whether this hop was asked for by a throttle (the downstream's "too many"): the record's
    /// next refusal is then its own, not a new throttle of its budget
    /// ([`BudgetPermit::throttled`](crate::BudgetPermit::throttled)).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub throttled: bool,
}

impl Deferral {
    pub fn total(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.total_ms)
    }
}

/// Longest correlation id a trigger carries, in bytes. Dataverse's and the Functions host's are
/// GUIDs (36 characters); Start refuses longer ones, so a trigger message stays small and its
/// poison entry always fits the queue's 64 KiB limit.
pub const MAX_CORRELATION_ID_LEN: usize = 128;

/// `text` cut to at most `max` bytes, at a character boundary.
pub(crate) fn truncate_to(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn bounded_correlation_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let id = Option::<String>::deserialize(d)?;
    Ok(id.map(|id| truncate_to(&id, MAX_CORRELATION_ID_LEN).to_string()))
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A queue message body that is not a trigger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a trigger message: {0}")]
pub struct DecodeError(String);

impl DecodeError {
    pub fn new(reason: impl Into<String>) -> Self {
        Self(reason.into())
    }
}

impl TriggerMessage {
    pub fn new(scope: Scope, record_id: RecordId) -> Self {
        Self {
            scope,
            record_id,
            kind: TriggerKind::Trigger,
            prior_attempts: 0,
            given_up: 0,
            correlation_id: None,
            rehides: 0,
            deferral: None,
            after_token: None,
            wait: None,
            traceparent: None,
            tracestate: None,
            links: Vec::new(),
        }
    }

    /// The trace context this message carries, if any.
    pub fn trace(&self) -> Option<TraceContext> {
        TraceContext::parse(self.traceparent.as_deref()?, self.tracestate.as_deref())
    }

    /// Carries `context` (the span that puts the message, or carries it on).
    pub fn set_trace(&mut self, context: &TraceContext) {
        self.traceparent = Some(context.traceparent());
        self.tracestate = context.state.clone();
    }

    /// The contexts of the coalesced triggers this message's run links to.
    pub fn link_contexts(&self) -> Vec<TraceContext> {
        self.links
            .iter()
            .filter_map(|t| TraceContext::parse(t, None))
            .collect()
    }

    /// A trigger for the record these texts name, once they are checked ([`Scope::parse`],
    /// [`RecordId::parse`]).
    pub fn parse(scope: &str, record_id: &str) -> Result<Self, InvalidName> {
        Ok(Self::new(Scope::parse(scope)?, RecordId::parse(record_id)?))
    }

    /// The lock key of the record.
    pub fn key(&self) -> LockKey {
        record_key(&self.scope, &self.record_id)
    }

    /// A follow-up of `self` of another kind that carries on the same chain of deliveries (a
    /// recheck, a watchdog, a retry): it keeps the record, the correlation id and the chain's
    /// give-up count ([`given_up`](Self::given_up)), with `prior_attempts` failed deliveries.
    /// It is a new queue message, so it carries no re-hides; it keeps the chain's deferral.
    pub fn follow_up(&self, kind: TriggerKind, prior_attempts: u32) -> Self {
        Self {
            kind,
            prior_attempts,
            rehides: 0,
            ..self.clone()
        }
    }

    /// The deferral of `self`'s chain by `after` more: a carrier ([`TriggerKind::Recheck`]) with
    /// `prior_attempts` failed deliveries, the delay added to the chain's total. It stands for
    /// this trigger and for the triggers that coalesced onto the run that asked.
    pub fn deferred(&self, prior_attempts: u32, after: std::time::Duration, id: u64) -> Self {
        let before = self.deferral.unwrap_or(Deferral {
            total_ms: 0,
            hops: 0,
            id,
            released: false,
            throttled: false,
        });
        Self {
            deferral: Some(Deferral {
                total_ms: before.total_ms.saturating_add(after.as_millis() as u64),
                hops: before.hops.saturating_add(1),
                id: before.id,
                released: true,
                throttled: false,
            }),
            wait: None,
            ..self.follow_up(TriggerKind::Recheck, prior_attempts)
        }
    }

    /// The message that looks again for a delivery that found the lease held and may not trust
    /// its holder: a follow-up of `kind`, which may stand in for that holder if it is dead (so a
    /// deferral's look again is no longer [`Deferral::released`]).
    pub fn looking_again(&self, kind: TriggerKind, prior_attempts: u32) -> Self {
        let mut again = self.follow_up(kind, prior_attempts);
        if let Some(d) = &mut again.deferral {
            d.released = false;
        }
        again
    }

    /// The retrigger a holder enqueues for triggers that coalesced onto its run: a new chain
    /// for the same record. It stands for fresh events, not for the holder's own delivery, so it
    /// starts with no failed attempts and a give-up count of 0 — a sweep's chain that ran
    /// passes nothing of its failures on, and its retrigger, if given up, gets a sweep that
    /// runs whatever the marker says.
    pub fn retrigger(&self) -> Self {
        Self {
            kind: TriggerKind::Retrigger,
            prior_attempts: 0,
            given_up: 0,
            rehides: 0,
            deferral: None,
            after_token: None,
            wait: None,
            // The holder names the triggers that coalesced onto its run (when it knows them).
            links: Vec::new(),
            ..self.clone()
        }
    }

    /// The JSON text (what the Functions host hands the handler after decoding base64).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a trigger message always serialises")
    }

    /// The queue wire form: base64 of the JSON.
    pub fn encode(&self) -> String {
        STANDARD.encode(self.to_json())
    }

    /// Reads the queue wire form: base64 of the JSON, or the JSON itself (messages put by tools
    /// that do not encode).
    pub fn decode(body: &str) -> Result<Self, DecodeError> {
        let body = body.trim();
        if body.starts_with('{') {
            return Self::from_json(body);
        }
        let bytes = STANDARD
            .decode(body)
            .map_err(|_| DecodeError("neither JSON nor base64".into()))?;
        let text =
            String::from_utf8(bytes).map_err(|_| DecodeError("base64 of something not UTF-8".into()))?;
        Self::from_json(&text)
    }

    /// Reads the JSON text; scope and record id are checked as Start checks them.
    pub fn from_json(text: &str) -> Result<Self, DecodeError> {
        serde_json::from_str(text).map_err(|e| DecodeError(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_base64_and_reads_plain_json() {
        let m = TriggerMessage::parse("account", "8f9c1d2e-0000-4000-8000-000000000001").unwrap();
        assert_eq!(TriggerMessage::decode(&m.encode()).unwrap(), m);
        assert_eq!(TriggerMessage::decode(&m.to_json()).unwrap(), m);
        assert_eq!(
            m.to_json(),
            r#"{"scope":"account","recordId":"8f9c1d2e-0000-4000-8000-000000000001","kind":"trigger"}"#
        );
        let r = m.follow_up(TriggerKind::Recheck, 3);
        assert_eq!(TriggerMessage::decode(&r.encode()).unwrap().prior_attempts, 3);
        let mut d = m.deferred(2, std::time::Duration::from_secs(30), 7);
        d.rehides = 4;
        assert_eq!(TriggerMessage::decode(&d.encode()).unwrap(), d);
        assert_eq!(
            d.to_json(),
            r#"{"scope":"account","recordId":"8f9c1d2e-0000-4000-8000-000000000001","kind":"recheck","priorAttempts":2,"rehides":4,"deferral":{"totalMs":30000,"hops":1,"id":7,"released":true}}"#
        );
    }

    /// A deferral adds to its chain's total and keeps its id; any follow-up is a new queue
    /// message (no re-hides) of the same chain (the deferral kept); a retrigger is a new chain.
    #[test]
    fn a_deferral_adds_up_along_its_chain() {
        let m = TriggerMessage::parse("account", "42").unwrap();
        let d1 = m.deferred(0, std::time::Duration::from_secs(30), 7);
        let mut d2 = d1.deferred(1, std::time::Duration::from_millis(1500), 99);
        assert_eq!(d2.kind, TriggerKind::Recheck);
        assert_eq!(
            d2.deferral,
            Some(Deferral {
                total_ms: 31_500,
                hops: 2,
                id: 7,
                released: true,
                throttled: false,
            })
        );
        d2.rehides = 3;
        let w = d2.follow_up(TriggerKind::Watchdog, 1);
        assert_eq!((w.rehides, w.deferral), (0, d2.deferral));
        // A look again keeps the chain's total but may stand in for a holder: no longer
        // released. A message written before the field existed reads as not released.
        let again = d2.looking_again(TriggerKind::Recheck, 1);
        assert_eq!(
            again.deferral.map(|d| (d.total_ms, d.released)),
            Some((31_500, false))
        );
        let old = TriggerMessage::decode(
            r#"{"scope":"account","recordId":"42","kind":"recheck","deferral":{"totalMs":1000,"hops":1,"id":7}}"#,
        )
        .unwrap();
        assert_eq!(old.deferral.map(|d| d.released), Some(false));
        let r = d2.retrigger();
        assert_eq!((r.rehides, r.deferral), (0, None));
    }

    /// A waiter's `wait` is its own: a retrigger or a deferral made from it is no waiter (nor a
    /// stand-in), while a follow-up of the same delivery (its watchdog, its retry) keeps it.
    #[test]
    fn only_a_follow_up_keeps_the_wait() {
        let mut m = TriggerMessage::parse("account", "42").unwrap();
        m.wait = Some(Wait {
            etag: Some("\"0x1\"".into()),
            waited_ms: 5_000,
            owed: true,
        });
        assert_eq!(m.follow_up(TriggerKind::Watchdog, 1).wait, m.wait);
        assert_eq!(m.retrigger().wait, None);
        assert_eq!(m.deferred(0, std::time::Duration::from_secs(1), 3).wait, None);
        assert_eq!(TriggerMessage::decode(&m.encode()).unwrap(), m);
        assert!(
            m.to_json()
                .contains(r#""wait":{"etag":"\"0x1\"","waitedMs":5000,"owed":true}"#),
            "{}",
            m.to_json()
        );
    }

    /// A message put by another tool is read into the form Start would have given it.
    #[test]
    fn reads_names_into_their_canonical_form() {
        let m = TriggerMessage::decode(
            r#"{"scope":"Account","recordId":"{8F9C1D2E-0000-4000-8000-000000000001}"}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            TriggerMessage::parse("account", "8f9c1d2e-0000-4000-8000-000000000001").unwrap()
        );
        assert_eq!(m.key().as_str(), "account/8f9c1d2e-0000-4000-8000-000000000001");
    }

    /// A correlation id longer than Start accepts, in a message another tool put, is cut when
    /// read: the trigger stays a trigger, and whatever is built from it stays small.
    #[test]
    fn reads_an_overlong_correlation_id_cut_to_the_limit() {
        let long = "é".repeat(30_000);
        let body = format!(r#"{{"scope":"account","recordId":"42","correlationId":"{long}"}}"#);
        let m = TriggerMessage::decode(&body).unwrap();
        let id = m.correlation_id.as_deref().unwrap();
        assert!(id.len() <= MAX_CORRELATION_ID_LEN && id.len() >= MAX_CORRELATION_ID_LEN - 1);
        assert!(long.starts_with(id));
        assert!(m.encode().len() < 1024, "{}", m.encode().len());
    }

    /// A cut never splits a character: it ends at the last boundary at or before the limit.
    #[test]
    fn truncation_keeps_whole_characters() {
        assert_eq!(truncate_to("aéé", 2), "a");
        assert_eq!(truncate_to("aéé", 4), "aé");
        assert_eq!(truncate_to("aéé", 5), "aéé");
        assert_eq!(truncate_to("abc", 2), "ab");
    }

    /// A retrigger is a new chain: no failed attempts and no give-ups carried over, whatever
    /// the message it came from had; the record and correlation id are kept.
    #[test]
    fn a_retrigger_starts_a_fresh_chain() {
        let mut m = TriggerMessage::parse("account", "42")
            .unwrap()
            .follow_up(TriggerKind::Watchdog, 3);
        m.given_up = 2;
        m.correlation_id = Some("c-1".into());
        let r = m.retrigger();
        assert_eq!(
            (r.kind, r.prior_attempts, r.given_up),
            (TriggerKind::Retrigger, 0, 0)
        );
        assert_eq!(
            (r.scope, r.record_id, r.correlation_id),
            (m.scope, m.record_id, m.correlation_id)
        );
    }

    #[test]
    fn rejects_what_is_not_a_trigger() {
        for body in [
            "",
            "hello",
            "e30=",
            r#"{"scope":"","recordId":"x"}"#,
            r#"{"recordId":"x"}"#,
            r#"{"scope":"a","recordId":"a/b"}"#,
            r#"{"scope":"a","recordId":"00000000-0000-0000-0000-000000000000"}"#,
        ] {
            assert!(TriggerMessage::decode(body).is_err(), "{body:?}");
        }
    }
}
