//! Traces through the queue: W3C Trace Context carried in trigger messages, and OpenTelemetry
//! spans for what happens to them.
//!
//! A storage queue message has no headers (and the Functions host passes no `traceparent` to a
//! custom handler), so a trigger carries its context in its body: `traceparent`, `tracestate`,
//! and, in a retrigger, `links`: the contexts of the triggers that coalesced onto the run that
//! put it. Start puts a message as a child of the caller's context (or of a new trace: Dataverse
//! sends none); each delivery is a consumer span (`process <queue>`) child of its message's
//! context, and every message a delivery puts (its retry, deferral, look again, retrigger)
//! carries the delivery's own context, so a chain of messages stays one trace. A run is a span
//! of its own (`run <scope>`) under the delivery that holds the lease, linked to every trigger
//! it covers; the logic gets its context (a URL logic as the `traceparent` header, a command as
//! `TRACEPARENT`), so a downstream's own spans join the trace.
//!
//! Spans go to the global OpenTelemetry tracer provider ([`opentelemetry::global`]); without one
//! (a library user who installs none, or the `leasehold` executable without
//! `OTEL_EXPORTER_OTLP_ENDPOINT`) nothing is recorded or exported, but the contexts are still
//! made and carried (for a message that has one), so trace ids still reach messages, logs,
//! history and the logic.

use std::borrow::Cow;

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue, global};

/// The name of this instrumentation (the tracer's scope).
pub const INSTRUMENTATION: &str = "leasehold";

/// The W3C header (and message field) naming the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header (and message field) with vendors' trace state.
pub const TRACESTATE: &str = "tracestate";

/// Longest `tracestate` carried, in bytes: W3C asks vendors to propagate at least 512 bytes; a
/// longer one is dropped (the traceparent is kept).
pub const MAX_TRACESTATE_LEN: usize = 512;

/// Most contexts of coalesced triggers a retrigger carries (and its run links to): a burst of
/// more triggers onto one run links to its latest ones.
pub const MAX_LINKS: usize = 16;

/// `messaging.system` of the spans: Azure Storage queues have no name among the OpenTelemetry
/// messaging conventions' values, so this one is ours.
pub const MESSAGING_SYSTEM: &str = "azure_storage_queue";

/// A W3C trace context: which trace, which span is the parent, whether it is sampled, and the
/// vendors' state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub sampled: bool,
    pub state: Option<String>,
}

impl TraceContext {
    /// Reads a `traceparent` (and `tracestate`) as W3C Trace Context level 1 says: version
    /// `00` exactly (55 characters), a later version by its first four fields; lower-case hex;
    /// neither id all zeros. `None` for anything else: an invalid context is not an error, the
    /// trace just starts afresh. A `tracestate` over [`MAX_TRACESTATE_LEN`] or malformed is
    /// dropped.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let text = traceparent.trim_matches([' ', '\t']);
        let bytes = text.as_bytes();
        if bytes.len() < 55 || !text.is_ascii() {
            return None;
        }
        let version = &text[..2];
        if !is_lower_hex(version) || version == "ff" {
            return None;
        }
        if (version == "00" && bytes.len() != 55) || (bytes.len() > 55 && bytes[55] != b'-') {
            return None;
        }
        if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
            return None;
        }
        let (trace, span, flags) = (&text[3..35], &text[36..52], &text[53..55]);
        if !is_lower_hex(trace) || !is_lower_hex(span) || !is_lower_hex(flags) {
            return None;
        }
        let trace_id = TraceId::from_hex(trace).ok()?;
        let span_id = SpanId::from_hex(span).ok()?;
        if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Self {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
            state: tracestate.and_then(checked_state),
        })
    }

    /// A new trace: random ids, sampled.
    pub fn root() -> Self {
        Self {
            trace_id: TraceId::from_bytes(uuid::Uuid::new_v4().into_bytes()),
            span_id: random_span_id(),
            sampled: true,
            state: None,
        }
    }

    /// A span of the same trace under this one: a new span id.
    pub fn child(&self) -> Self {
        Self {
            span_id: random_span_id(),
            ..self.clone()
        }
    }

    /// The `traceparent` text.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            self.trace_id,
            self.span_id,
            u8::from(self.sampled)
        )
    }

    /// The trace id, as 32 hex digits (as logs, history and Application Insights' operation id
    /// show it).
    pub fn trace_id_hex(&self) -> String {
        self.trace_id.to_string()
    }

    fn span_context(&self, remote: bool) -> SpanContext {
        let flags = if self.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let state = self
            .state
            .as_deref()
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        SpanContext::new(self.trace_id, self.span_id, flags, remote, state)
    }

    fn of(sc: &SpanContext) -> Self {
        let state = sc.trace_state().header();
        Self {
            trace_id: sc.trace_id(),
            span_id: sc.span_id(),
            sampled: sc.is_sampled(),
            state: (!state.is_empty()).then_some(state),
        }
    }
}

impl std::fmt::Display for TraceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.traceparent())
    }
}

fn is_lower_hex(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn random_span_id() -> SpanId {
    loop {
        let (id, _) = uuid::Uuid::new_v4().as_u64_pair();
        if id != 0 {
            return SpanId::from_bytes(id.to_be_bytes());
        }
    }
}

/// A `tracestate` worth carrying: within [`MAX_TRACESTATE_LEN`], visible ASCII, and as W3C
/// forms it (the OpenTelemetry parser's check).
pub(crate) fn checked_state(text: &str) -> Option<String> {
    let text = text.trim_matches([' ', '\t']);
    if text.is_empty() || text.len() > MAX_TRACESTATE_LEN || !text.bytes().all(|b| (0x20..0x7f).contains(&b))
    {
        return None;
    }
    text.parse::<TraceState>().ok().map(|s| s.header())
}

/// A span of this process, ended when dropped. Its context ([`context`](Self::context)) is the
/// exported span's when a tracer provider made one, else one made here (same trace as the
/// parent, a new span id), so what it carries on is the same either way.
pub struct Span {
    cx: Context,
    context: Option<TraceContext>,
    /// Whether the tracer provider made the span (its id), rather than this module.
    recorded: bool,
}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Span")
            .field("context", &self.context)
            .field("recorded", &self.recorded)
            .finish()
    }
}

impl Span {
    /// Starts a span under `parent` (a context from a message or a header), linked to `links`.
    /// Without a parent it is a new trace's root if a tracer provider makes one; without either,
    /// the span has no context (a message from a tool that sent none, with tracing off).
    pub fn start(
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        parent: Option<&TraceContext>,
        links: &[TraceContext],
        attributes: Vec<KeyValue>,
    ) -> Self {
        let parent_cx = match parent {
            Some(p) => Context::new().with_remote_span_context(p.span_context(true)),
            None => Context::new(),
        };
        Self::build(name, kind, &parent_cx, parent, links, attributes)
    }

    /// [`start`](Self::start), with a new trace when there is no parent and no tracer provider
    /// (Start answers every trigger with its trace id).
    pub fn start_or_root(
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        parent: Option<&TraceContext>,
        attributes: Vec<KeyValue>,
    ) -> Self {
        let mut span = Self::start(name, kind, parent, &[], attributes);
        if span.context.is_none() {
            span.context = Some(TraceContext::root());
        }
        span
    }

    /// A span under this one.
    pub fn child(
        &self,
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        links: &[TraceContext],
        attributes: Vec<KeyValue>,
    ) -> Self {
        match (&self.context, self.recorded) {
            (Some(_), true) => Self::build(name, kind, &self.cx, self.context.as_ref(), links, attributes),
            (Some(own), false) => Self::start(name, kind, Some(own), links, attributes),
            (None, _) => Self::start(name, kind, None, links, attributes),
        }
    }

    fn build(
        name: impl Into<Cow<'static, str>>,
        kind: SpanKind,
        parent_cx: &Context,
        parent: Option<&TraceContext>,
        links: &[TraceContext],
        attributes: Vec<KeyValue>,
    ) -> Self {
        let tracer = global::tracer(INSTRUMENTATION);
        let builder = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .with_links(
                links
                    .iter()
                    .map(|l| Link::with_context(l.span_context(true)))
                    .collect(),
            );
        let span = tracer.build_with_context(builder, parent_cx);
        let sc = span.span_context().clone();
        // A tracer that records nothing hands back its parent's context: the span is then ours
        // to name.
        let made = sc.is_valid() && parent.is_none_or(|p| p.span_id != sc.span_id());
        let context = if made {
            Some(TraceContext::of(&sc))
        } else {
            parent.map(TraceContext::child)
        };
        Self {
            cx: Context::new().with_span(span),
            context,
            recorded: made,
        }
    }

    /// The context to carry on (into a message, a header, a child), if the span has one.
    pub fn context(&self) -> Option<&TraceContext> {
        self.context.as_ref()
    }

    /// Sets an attribute.
    pub fn set(&self, attribute: KeyValue) {
        if self.recorded {
            self.cx.span().set_attribute(attribute);
        }
    }

    /// Marks the span failed, with `message`.
    pub fn fail(&self, message: impl Into<Cow<'static, str>>) {
        if self.recorded {
            self.cx.span().set_status(Status::error(message));
        }
    }

    /// Ends the span now (dropping it does too).
    pub fn end(self) {
        if self.recorded {
            self.cx.span().end();
        }
    }
}

/// The span of putting a new trigger `message` on `queue` (Start, `leasehold enqueue`): a
/// producer span under `parent` (the caller's context), or a new trace's root; the message
/// carries its context. End it once the message is put.
pub fn send(queue: &str, message: &mut crate::TriggerMessage, parent: Option<&TraceContext>) -> Span {
    let mut attributes = vec![
        KeyValue::new("messaging.system", MESSAGING_SYSTEM),
        KeyValue::new("messaging.operation.type", "send"),
        KeyValue::new("messaging.operation.name", "send"),
        KeyValue::new("messaging.destination.name", queue.to_string()),
        KeyValue::new("leasehold.scope", message.scope.to_string()),
        KeyValue::new("leasehold.record", message.record_id.to_string()),
    ];
    if let Some(id) = &message.correlation_id {
        attributes.push(KeyValue::new("messaging.message.conversation_id", id.clone()));
    }
    let span = Span::start_or_root(format!("send {queue}"), SpanKind::Producer, parent, attributes);
    if let Some(context) = span.context() {
        message.set_trace(context);
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_is_read_as_w3c_says_and_anything_else_starts_afresh() {
        let ctx = TraceContext::parse(GOOD, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(ctx.traceparent(), GOOD);
        assert_eq!(ctx.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(ctx.sampled);
        assert_eq!(ctx.state.as_deref(), Some("congo=t61rcWkgMzE"));
        // A later version is read by its first four fields; version 00 must be exact.
        assert!(TraceContext::parse(&format!("01{}-more", &GOOD[2..]), None).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é6-00f067aa0ba902b-01",
        ] {
            assert_eq!(TraceContext::parse(bad, None), None, "{bad:?}");
        }
        let unsampled = TraceContext::parse(&GOOD.replace("-01", "-00"), None).unwrap();
        assert!(!unsampled.sampled);
        // A trace state too long or malformed is dropped, the context kept.
        let long = format!("a={}", "x".repeat(MAX_TRACESTATE_LEN));
        assert_eq!(TraceContext::parse(GOOD, Some(&long)).unwrap().state, None);
        assert_eq!(TraceContext::parse(GOOD, Some("\u{7}=x")).unwrap().state, None);
    }

    #[test]
    fn without_a_tracer_a_span_under_a_context_gets_an_id_of_its_own_and_none_without_one() {
        let parent = TraceContext::parse(GOOD, Some("k=v")).unwrap();
        let span = Span::start("process", SpanKind::Consumer, Some(&parent), &[], vec![]);
        let ctx = span.context().unwrap().clone();
        assert_eq!(ctx.trace_id, parent.trace_id);
        assert_ne!(ctx.span_id, parent.span_id);
        assert_eq!(ctx.state.as_deref(), Some("k=v"));
        let child = span.child("run", SpanKind::Internal, std::slice::from_ref(&parent), vec![]);
        let grandchild = child.context().unwrap();
        assert_eq!(grandchild.trace_id, parent.trace_id);
        assert_ne!(grandchild.span_id, ctx.span_id);
        assert!(
            Span::start("process", SpanKind::Consumer, None, &[], vec![])
                .context()
                .is_none()
        );
        let root = Span::start_or_root("send", SpanKind::Producer, None, vec![]);
        assert_ne!(root.context().unwrap().trace_id, parent.trace_id);
    }
}
