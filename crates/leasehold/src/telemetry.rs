//! The application's metrics. The libraries count through the [`metrics`] facade (a no-op
//! without a recorder); the application installs one recorder per process ([`install`]) that
//! feeds two readers:
//!
//! * the Prometheus recorder of `metrics-exporter-prometheus`, which `serve` renders at
//!   `GET /metrics` ([`router`]) behind Start's key;
//! * running totals ([`Totals`]), from which a task ([`Sampler`]) logs, in handler mode, one
//!   `metrics` event per interval with what changed since the last one (no scraper reaches a
//!   Functions instance; its logs reach Application Insights).
//!
//! The same task samples the queue gauges, in both modes: by requests of its own, never on a
//! trigger's path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::Query;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use leasehold_functions::http::START_RESPONSES_TOTAL;
use leasehold_functions::start::{StartPolicy, key_accepted};
use leasehold_runtime::observe::{DEFERRAL_SECONDS, DELIVERIES_TOTAL, LOCK_SECONDS, RUN_DURATION_SECONDS};
use leasehold_runtime::{OutcomeLabel, TriggerQueue};
use leasehold_storage::azure::{STORAGE_ERRORS_TOTAL, STORAGE_REQUESTS_TOTAL};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::layers::FanoutBuilder;
use metrics_util::registry::{AtomicStorage, Registry};
use tokio_util::sync::CancellationToken;

/// Default of `LEASEHOLD_METRICS_INTERVAL_SECONDS`.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// Gauge: approximate number of messages in the trigger queue (visible or not).
pub const QUEUE_MESSAGES: &str = "leasehold_queue_messages";
/// Gauge: approximate number of messages in the poison queue.
pub const POISON_MESSAGES: &str = "leasehold_poison_messages";
/// Gauge: the low lane's trigger queue's approximate depth.
pub const LOW_QUEUE_MESSAGES: &str = "leasehold_low_queue_messages";
/// Gauge: the low lane's poison queue's approximate depth.
pub const LOW_POISON_MESSAGES: &str = "leasehold_low_poison_messages";
/// Gauge: how long the front visible message of the trigger queue has waited (0 when none).
pub const OLDEST_MESSAGE_AGE_SECONDS: &str = "leasehold_oldest_message_age_seconds";

/// The target and message of the handler's metrics event.
pub const EVENT_TARGET: &str = "leasehold::metrics";

const RUN_BUCKETS: &[f64] = &[0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0];
const LOCK_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Deferral delays: from a second to the longest a queue message can stay hidden (7 days).
const DEFERRAL_BUCKETS: &[f64] = &[
    1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 21600.0, 86400.0, 604800.0,
];

/// What the process's recorder feeds.
struct Telemetry {
    prometheus: PrometheusHandle,
    totals: Arc<Registry<Key, AtomicStorage>>,
    /// Counter values at the last event, to report what changed since.
    reported: Mutex<HashMap<Key, u64>>,
}

/// Installs the process's recorder, once (later calls, as from several applications built in
/// one process, return the same). If something else installed a global recorder first, that
/// one keeps receiving the metrics: `/metrics` and the event then stay empty (said once).
fn install() -> &'static Telemetry {
    static INSTALLED: OnceLock<Telemetry> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let prometheus = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(RUN_DURATION_SECONDS.into()), RUN_BUCKETS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(LOCK_SECONDS.into()), LOCK_BUCKETS))
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(DEFERRAL_SECONDS.into()), DEFERRAL_BUCKETS))
            .expect("bucket lists are not empty")
            .build_recorder();
        let handle = prometheus.handle();
        let totals = Arc::new(Registry::atomic());
        let recorder = FanoutBuilder::default()
            .add_recorder(prometheus)
            .add_recorder(Totals(totals.clone()))
            .build();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!(
                "another metrics recorder is installed in this process: it receives Leasehold's metrics, so GET /metrics and the metrics event stay empty"
            );
        }
        describe();
        Telemetry {
            prometheus: handle,
            totals,
            reported: Mutex::default(),
        }
    })
}

/// Installs the recorder (see [`install`]); the application calls it before it serves.
pub(crate) fn init() {
    install();
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        DELIVERIES_TOTAL,
        Unit::Count,
        "Deliveries of trigger messages, by outcome."
    );
    describe_histogram!(
        RUN_DURATION_SECONDS,
        Unit::Seconds,
        "How long a record's logic ran (every run, successful or not)."
    );
    describe_histogram!(
        DEFERRAL_SECONDS,
        Unit::Seconds,
        "Delays of runs put off because their logic asked to be run later."
    );
    describe_histogram!(
        LOCK_SECONDS,
        Unit::Seconds,
        "Lock overhead: from asking for the lease to holding it (grant), and releasing it (release)."
    );
    describe_counter!(
        STORAGE_REQUESTS_TOTAL,
        Unit::Count,
        "Azure Storage round trips sent, by operation."
    );
    describe_counter!(
        STORAGE_ERRORS_TOTAL,
        Unit::Count,
        "Failed Azure Storage round trips, by operation and class (some are the protocol's expected answers, e.g. lease_already_present)."
    );
    describe_counter!(
        START_RESPONSES_TOTAL,
        Unit::Count,
        "Start's answers to its callers, by HTTP status."
    );
    describe_gauge!(
        QUEUE_MESSAGES,
        Unit::Count,
        "Approximate number of messages in the trigger queue."
    );
    describe_gauge!(
        POISON_MESSAGES,
        Unit::Count,
        "Approximate number of messages in the poison queue."
    );
    describe_gauge!(
        LOW_QUEUE_MESSAGES,
        Unit::Count,
        "Approximate number of messages in the low lane's trigger queue (bulk traffic)."
    );
    describe_gauge!(
        LOW_POISON_MESSAGES,
        Unit::Count,
        "Approximate number of messages in the low lane's poison queue."
    );
    describe_gauge!(
        OLDEST_MESSAGE_AGE_SECONDS,
        Unit::Seconds,
        "Age of the front visible message of the trigger queue (0 when none is visible)."
    );
}

/// Running totals of every metric, for the metrics event: counters and gauges as atomics,
/// histogram observations kept until the next event takes them.
struct Totals(Arc<Registry<Key, AtomicStorage>>);

impl Recorder for Totals {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.0.get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

fn label<'a>(key: &'a Key, name: &str) -> Option<&'a str> {
    key.labels().find(|l| l.key() == name).map(|l| l.value())
}

/// Count, sum and quantiles of a histogram's observations over one interval.
#[derive(Debug, Default, Clone, PartialEq)]
struct Summary {
    values: Vec<f64>,
}

impl Summary {
    fn count(&self) -> u64 {
        self.values.len() as u64
    }

    fn sum(&self) -> f64 {
        self.values.iter().sum()
    }

    /// The nearest-rank `q` quantile; `None` without observations.
    fn quantile(&mut self, q: f64) -> Option<f64> {
        if self.values.is_empty() {
            return None;
        }
        self.values.sort_by(f64::total_cmp);
        let rank = ((q * self.values.len() as f64).ceil() as usize).clamp(1, self.values.len());
        Some(self.values[rank - 1])
    }

    fn max(&self) -> Option<f64> {
        self.values.iter().copied().reduce(f64::max)
    }
}

/// What changed since the last event.
#[derive(Debug, Default)]
struct Changes {
    deliveries: HashMap<&'static str, u64>,
    storage_requests: u64,
    storage_errors: u64,
    storage_errors_transient: u64,
    start: [u64; 3],
    run: Summary,
    lock_grant: Summary,
    lock_release: Summary,
}

impl Telemetry {
    /// Takes the counters' increments and the histograms' observations since the last call.
    fn take_changes(&self) -> Changes {
        let mut changes = Changes::default();
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        self.totals.visit_counters(|key, counter| {
            let now = counter.load(std::sync::atomic::Ordering::Relaxed);
            let before = reported.insert(key.clone(), now).unwrap_or(0);
            let delta = now.saturating_sub(before);
            match key.name() {
                DELIVERIES_TOTAL => {
                    if let Some(outcome) = label(key, "outcome")
                        .and_then(|o| OutcomeLabel::ALL.into_iter().find(|l| l.as_str() == o))
                    {
                        *changes.deliveries.entry(outcome.as_str()).or_default() += delta;
                    }
                }
                STORAGE_REQUESTS_TOTAL => changes.storage_requests += delta,
                STORAGE_ERRORS_TOTAL => {
                    changes.storage_errors += delta;
                    if matches!(label(key, "class"), Some("transient" | "timeout")) {
                        changes.storage_errors_transient += delta;
                    }
                }
                START_RESPONSES_TOTAL => match label(key, "status").and_then(|s| s.parse::<u16>().ok()) {
                    Some(200..=299) => changes.start[0] += delta,
                    Some(400..=499) => changes.start[1] += delta,
                    Some(500..=599) => changes.start[2] += delta,
                    _ => {}
                },
                _ => {}
            }
        });
        self.totals.visit_histograms(|key, bucket| {
            let into = match (key.name(), label(key, "step")) {
                (RUN_DURATION_SECONDS, _) => &mut changes.run,
                (LOCK_SECONDS, Some("grant")) => &mut changes.lock_grant,
                (LOCK_SECONDS, Some("release")) => &mut changes.lock_release,
                _ => return,
            };
            bucket.clear_with(|values| into.values.extend_from_slice(values));
        });
        changes
    }
}

/// The queue gauges as sampled at one tick (`None`: that request failed).
#[derive(Debug, Default, Clone, Copy)]
struct Gauges {
    queue_messages: Option<u64>,
    poison_messages: Option<u64>,
    low_queue_messages: Option<u64>,
    low_poison_messages: Option<u64>,
    oldest_message_age_seconds: Option<f64>,
}

/// The task that samples the queue gauges every interval and, in handler mode, logs the
/// metrics event.
#[derive(Debug, Clone)]
pub(crate) struct Sampler {
    pub(crate) queue: Arc<dyn TriggerQueue>,
    pub(crate) poison: Arc<dyn TriggerQueue>,
    /// The low lane's queue and poison queue.
    pub(crate) low_queue: Arc<dyn TriggerQueue>,
    pub(crate) low_poison: Arc<dyn TriggerQueue>,
    pub(crate) interval: Duration,
    /// Log the metrics event each interval (handler mode).
    pub(crate) log_event: bool,
}

impl Sampler {
    /// Runs until `stop` fires: samples at once, then every interval. A failed sample is a
    /// warning; the next tick tries again.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let telemetry = install();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = tokio::time::Instant::now();
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let gauges = tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                g = self.sample() => g,
            };
            telemetry.prometheus.run_upkeep();
            let changes = telemetry.take_changes();
            if self.log_event {
                log_event(changes, gauges, last.elapsed());
            }
            last = tokio::time::Instant::now();
        }
    }

    /// Reads the queue depths (both lanes') and the high lane's front message's age (five
    /// requests at once), and sets the gauges of those that answered.
    async fn sample(&self) -> Gauges {
        let (queue, poison, front, low_queue, low_poison) = tokio::join!(
            self.queue.approximate_len(),
            self.poison.approximate_len(),
            self.queue.peek(1),
            self.low_queue.approximate_len(),
            self.low_poison.approximate_len(),
        );
        let mut gauges = Gauges::default();
        for (result, slot, queue, gauge) in [
            (
                low_queue,
                &mut gauges.low_queue_messages,
                &self.low_queue,
                LOW_QUEUE_MESSAGES,
            ),
            (
                low_poison,
                &mut gauges.low_poison_messages,
                &self.low_poison,
                LOW_POISON_MESSAGES,
            ),
        ] {
            match result {
                Ok(n) => {
                    *slot = Some(n);
                    metrics::gauge!(gauge).set(n as f64);
                }
                Err(e) => {
                    tracing::warn!(queue = queue.name(), error = %e, "metrics: reading the queue depth failed; trying again at the next tick")
                }
            }
        }
        match queue {
            Ok(n) => gauges.queue_messages = Some(n),
            Err(e) => {
                tracing::warn!(queue = self.queue.name(), error = %e, "metrics: reading the queue depth failed; trying again at the next tick")
            }
        }
        match poison {
            Ok(n) => gauges.poison_messages = Some(n),
            Err(e) => {
                tracing::warn!(queue = self.poison.name(), error = %e, "metrics: reading the poison queue depth failed; trying again at the next tick")
            }
        }
        match front {
            Ok(peeked) => {
                let age = peeked
                    .first()
                    .and_then(|m| m.inserted_at)
                    .map(|at| SystemTime::now().duration_since(at).unwrap_or_default())
                    .unwrap_or_default();
                gauges.oldest_message_age_seconds = Some(age.as_secs_f64());
            }
            Err(e) => {
                tracing::warn!(queue = self.queue.name(), error = %e, "metrics: peeking at the queue failed; trying again at the next tick")
            }
        }
        if let Some(n) = gauges.queue_messages {
            metrics::gauge!(QUEUE_MESSAGES).set(n as f64);
        }
        if let Some(n) = gauges.poison_messages {
            metrics::gauge!(POISON_MESSAGES).set(n as f64);
        }
        if let Some(age) = gauges.oldest_message_age_seconds {
            metrics::gauge!(OLDEST_MESSAGE_AGE_SECONDS).set(age);
        }
        gauges
    }
}

/// Rounds seconds to the millisecond, so the event reads well.
fn ms(seconds: Option<f64>) -> Option<f64> {
    seconds.map(|s| (s * 1000.0).round() / 1000.0)
}

/// The handler's metrics event: one line with what changed since the last one and the gauges
/// as just sampled. Its fields are documented in docs/operating.md (*Metrics*); keep the two in step.
fn log_event(mut c: Changes, g: Gauges, since_last: Duration) {
    let d = |label: OutcomeLabel| c.deliveries.get(label.as_str()).copied().unwrap_or(0);
    let (completed, retriggered, coalesced, rechecked, failed, lease_lost, poisoned) = (
        d(OutcomeLabel::Completed),
        d(OutcomeLabel::Retriggered),
        d(OutcomeLabel::Coalesced),
        d(OutcomeLabel::Rechecked),
        d(OutcomeLabel::Failed),
        d(OutcomeLabel::LeaseLost),
        d(OutcomeLabel::Poisoned),
    );
    let (deferred, superseded) = (d(OutcomeLabel::Deferred), d(OutcomeLabel::Superseded));
    let (waiting, debounced) = (d(OutcomeLabel::Waiting), d(OutcomeLabel::Debounced));
    let paused = d(OutcomeLabel::Paused);
    let (run_p50, run_p95) = (c.run.quantile(0.5), c.run.quantile(0.95));
    tracing::info!(
        target: EVENT_TARGET,
        interval_seconds = ms(Some(since_last.as_secs_f64())),
        deliveries_completed = completed,
        deliveries_retriggered = retriggered,
        deliveries_coalesced = coalesced,
        deliveries_rechecked = rechecked,
        deliveries_failed = failed,
        deliveries_lease_lost = lease_lost,
        deliveries_poisoned = poisoned,
        deliveries_deferred = deferred,
        deliveries_superseded = superseded,
        deliveries_waiting = waiting,
        deliveries_debounced = debounced,
        deliveries_paused = paused,
        storage_requests = c.storage_requests,
        storage_errors = c.storage_errors,
        storage_errors_transient = c.storage_errors_transient,
        start_2xx = c.start[0],
        start_4xx = c.start[1],
        start_5xx = c.start[2],
        runs = c.run.count(),
        run_duration_sum_seconds = ms(Some(c.run.sum())),
        run_duration_p50_seconds = ms(run_p50),
        run_duration_p95_seconds = ms(run_p95),
        run_duration_max_seconds = ms(c.run.max()),
        lock_grant_p95_seconds = ms(c.lock_grant.quantile(0.95)),
        lock_release_p95_seconds = ms(c.lock_release.quantile(0.95)),
        queue_messages = g.queue_messages,
        poison_messages = g.poison_messages,
        low_queue_messages = g.low_queue_messages,
        low_poison_messages = g.low_poison_messages,
        oldest_message_age_seconds = ms(g.oldest_message_age_seconds),
        "metrics"
    );
}

/// `GET /metrics` in the Prometheus text format, behind Start's key (`x-functions-key` header
/// or `code` query parameter, checked as Start checks it; open when Start has no key).
pub(crate) fn router(policy: StartPolicy) -> Router {
    let policy = Arc::new(policy);
    Router::new().route(
        "/metrics",
        get(
            move |headers: HeaderMap, Query(query): Query<Vec<(String, String)>>| {
                let policy = policy.clone();
                async move { scrape(&policy, &headers, &query) }
            },
        ),
    )
}

fn scrape(policy: &StartPolicy, headers: &HeaderMap, query: &[(String, String)]) -> Response {
    let header = headers.get("x-functions-key").and_then(|v| v.to_str().ok());
    let code = query.iter().find(|(k, _)| k == "code").map(|(_, v)| v.as_str());
    if !key_accepted(policy, header, code) {
        tracing::warn!(status = 401, "metrics: scrape refused: missing or wrong key");
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({
                "error": "missing or wrong key: send it as the x-functions-key header or the code query parameter"
            })),
        )
            .into_response();
    }
    if policy.api_key.is_none() && policy.refuse_web_pages {
        let value = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        if let Err(refused) = leasehold_functions::start::refuse_web_pages(value("origin"), value("host")) {
            return (
                StatusCode::FORBIDDEN,
                axum::Json(serde_json::json!({ "error": refused.to_string() })),
            )
                .into_response();
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        install().prometheus.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank_over_the_interval() {
        let mut s = Summary {
            values: (1..=100).rev().map(f64::from).collect(),
        };
        assert_eq!(
            (s.quantile(0.5), s.quantile(0.95), s.max(), s.count()),
            (Some(50.0), Some(95.0), Some(100.0), 100)
        );
        assert_eq!(s.sum(), 5050.0);
        let mut one = Summary { values: vec![2.5] };
        assert_eq!((one.quantile(0.5), one.quantile(0.95)), (Some(2.5), Some(2.5)));
        let mut none = Summary::default();
        assert_eq!((none.quantile(0.5), none.max(), none.count()), (None, None, 0));
    }
}
