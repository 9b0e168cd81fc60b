//! The runner's spans ([`crate::trace`]): a delivery's `process` span, its run's `run` span
//! linked to every trigger the run covers, and the lease's acquire and release under them.
//!
//! Which triggers a run covers: the one its message is for (or the chain it carries on), the
//! ones its message names in `links` (a retrigger names those that coalesced onto the run that
//! put it), and, in a retrigger this process puts, the triggers that coalesced onto the run in
//! this process ([`CoalescedLinks`]). A trigger that coalesced onto a holder in another process
//! is not named (telling it would cost a storage request per trigger); its own span says it
//! coalesced, and the record's history says onto which run.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_lock::LockKey;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::time::Instant;

use super::{Delivery, Outcome, RecordRunner};
use crate::trace::{MAX_LINKS, MESSAGING_SYSTEM, Span, TraceContext};

/// A delivery's spans: its `process` span, and the context its message arrived with.
#[derive(Debug)]
pub(crate) struct DeliveryTrace {
    pub(crate) process: Span,
    /// The context of the message as delivered (the trigger, or the delivery it carries on).
    pub(crate) origin: Option<TraceContext>,
}

/// Records with more than this many coalesced triggers waiting to be named are forgotten first
/// (oldest first), so the map stays small whatever happens to the runs they coalesced onto.
const MAX_RECORDS: usize = 1024;

/// How long a coalesced trigger's context waits for this process's holder to name it: a trigger
/// that coalesced onto a holder in another process is never taken here.
const KEEP_FOR: Duration = Duration::from_secs(3600);

/// The contexts of triggers that coalesced onto runs in this process, by record, until the
/// holder's retrigger (or deferral) takes them.
#[derive(Debug, Clone, Default)]
pub(crate) struct CoalescedLinks(Arc<Mutex<Links>>);

#[derive(Debug, Default)]
struct Links {
    by_record: HashMap<LockKey, VecDeque<(Instant, TraceContext)>>,
    order: VecDeque<LockKey>,
}

impl CoalescedLinks {
    pub(crate) fn add(&self, key: &LockKey, context: TraceContext) {
        let mut links = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if !links.by_record.contains_key(key) {
            while links.by_record.len() >= MAX_RECORDS {
                let Some(oldest) = links.order.pop_front() else {
                    break;
                };
                links.by_record.remove(&oldest);
            }
            links.order.push_back(key.clone());
        }
        let contexts = links.by_record.entry(key.clone()).or_default();
        contexts.retain(|(at, _)| now.duration_since(*at) < KEEP_FOR);
        if contexts.len() == MAX_LINKS {
            contexts.pop_front();
        }
        contexts.push_back((now, context));
    }

    /// The contexts waiting for `key`'s holder, as `traceparent`s (at most [`MAX_LINKS`]).
    pub(crate) fn take(&self, key: &LockKey) -> Vec<String> {
        let mut links = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(contexts) = links.by_record.remove(key) else {
            return Vec::new();
        };
        links.order.retain(|k| k != key);
        let now = Instant::now();
        contexts
            .into_iter()
            .filter(|(at, _)| now.duration_since(*at) < KEEP_FOR)
            .map(|(_, c)| c.traceparent())
            .collect()
    }
}

impl RecordRunner {
    /// Starts `delivery`'s `process` span (a consumer span under its message's context) and
    /// returns the delivery as the rest of the protocol sees it: every message it puts carries
    /// the span's context. `None` when there is no trace (a message with no context, with no
    /// tracer provider installed): the delivery goes on untouched.
    pub(crate) fn trace_delivery(&self, delivery: &Delivery) -> Option<(Delivery, Arc<DeliveryTrace>)> {
        let message = &delivery.message;
        let origin = message.trace();
        let mut attributes = vec![
            KeyValue::new("messaging.system", MESSAGING_SYSTEM),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.operation.name", "process"),
            KeyValue::new("messaging.destination.name", self.queue.name().to_string()),
            KeyValue::new("leasehold.scope", message.scope.to_string()),
            KeyValue::new("leasehold.record", message.record_id.to_string()),
            KeyValue::new("leasehold.kind", format!("{:?}", message.kind).to_lowercase()),
            KeyValue::new("leasehold.attempt", i64::from(delivery.attempts())),
            KeyValue::new("leasehold.lane", self.lane.as_str()),
        ];
        if let Some(id) = &message.correlation_id {
            attributes.push(KeyValue::new("messaging.message.conversation_id", id.clone()));
        }
        let span = Span::start(
            format!("process {}", self.queue.name()),
            SpanKind::Consumer,
            origin.as_ref(),
            &[],
            attributes,
        );
        let context = span.context()?.clone();
        tracing::Span::current().record("trace_id", context.trace_id_hex());
        let mut traced = delivery.clone();
        traced.message.set_trace(&context);
        Some((
            traced,
            Arc::new(DeliveryTrace {
                process: span,
                origin,
            }),
        ))
    }

    /// The `run` span of a delivery that holds the lease, linked to every trigger its run
    /// covers.
    pub(crate) fn run_span(&self, delivery: &Delivery, trace: &DeliveryTrace, token: Option<u64>) -> Span {
        let message = &delivery.message;
        let mut links: Vec<TraceContext> = trace.origin.iter().cloned().collect();
        links.extend(message.link_contexts());
        let mut attributes = vec![
            KeyValue::new("leasehold.scope", message.scope.to_string()),
            KeyValue::new("leasehold.record", message.record_id.to_string()),
            KeyValue::new("leasehold.attempt", i64::from(delivery.attempts())),
            KeyValue::new("leasehold.covers", links.len() as i64),
        ];
        if let Some(token) = token {
            attributes.push(KeyValue::new("leasehold.fencing_token", token as i64));
        }
        trace.process.child(
            format!("run {}", message.scope),
            SpanKind::Internal,
            &links,
            attributes,
        )
    }

    /// A span for one step of the lease's (acquire, release) under `parent`, if traced.
    pub(crate) fn lease_span(parent: Option<&Span>, step: &'static str) -> Option<Span> {
        parent.map(|p| p.child(format!("lease {step}"), SpanKind::Internal, &[], Vec::new()))
    }

    /// Tells the `process` span how its delivery ended; a trigger that coalesced onto a run
    /// here is kept for the holder's retrigger to name.
    pub(crate) fn trace_outcome(
        &self,
        delivery: &Delivery,
        trace: &DeliveryTrace,
        outcome: &Outcome,
        token: Option<u64>,
    ) {
        let span = &trace.process;
        span.set(KeyValue::new("leasehold.outcome", outcome.label().as_str()));
        if let Some(token) = token {
            span.set(KeyValue::new("leasehold.fencing_token", token as i64));
        }
        if let Some(error) = outcome.error() {
            span.fail(error.to_string());
        }
        if matches!(outcome, Outcome::Coalesced)
            && let Some(context) = span.context()
        {
            self.coalesced.add(&delivery.message.key(), context.clone());
        }
    }
}
