//! Wiring the long-running modes: standalone (Start endpoint and queue consumer in one process)
//! and the Azure Functions custom handler.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use leasehold_functions::http::{App, LaneParts, handler_router, standalone_router};
use leasehold_functions::logic::{DemoLogic, UrlLogic};
use leasehold_lock::OpCounters;
use leasehold_ops::Operator;
use leasehold_ops::wiring::{Wiring, wire};
use leasehold_runtime::{
    AzureQueue, Budgets, Consumer, History, HistoryOptions, Lane, Logic, RecordRunner, TriggerQueue,
    low_queue_name, poison_queue_name,
};
use leasehold_storage::azure::BlobContainer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admin;
use crate::server::{self, HttpOptions};
use crate::settings::{LogicSetting, Settings};
use crate::telemetry::{self, Sampler};
use crate::traces::Traces;

/// How long a stopping process gives its last spans to reach the collector.
const TRACES_FLUSH_AT_STOP: Duration = Duration::from_secs(5);

/// Which long-running mode to build.
#[derive(Debug, Clone)]
pub enum Mode {
    /// The Start endpoint (`POST /api/start`, `GET /healthz`) and a queue consumer in one
    /// process. `port` overrides `LEASEHOLD_PORT` (0: any free port); `demo` runs the demo logic
    /// when no logic is configured.
    Standalone { port: Option<u16>, demo: bool },
    /// An Azure Functions custom handler on 127.0.0.1:`FUNCTIONS_CUSTOMHANDLER_PORT` (`GET /`,
    /// `POST /Start`, `POST /Worker`).
    Handler,
}

/// A built application: its listener is bound and its storage wired; nothing runs until
/// [`run_until_stopped`](Self::run_until_stopped).
pub struct Application {
    listener: TcpListener,
    port: u16,
    /// The liveness probe's own listener (`LEASEHOLD_HEALTH_PORT`, standalone).
    health: Option<TcpListener>,
    shutdown: CancellationToken,
    router: axum::Router,
    consumer: Option<Consumer>,
    description: String,
    /// The HTTP limits, the connection bound already capped to the descriptors
    /// ([`Application::http_options`]).
    http: HttpOptions,
    /// Samples the queue gauges (and, in handler mode, logs the metrics event) every interval.
    sampler: Sampler,
    /// The run history writer both lanes write to (`None`: `LEASEHOLD_HISTORY=false`).
    history: Option<History>,
    /// The span exporter, when `OTEL_EXPORTER_OTLP_ENDPOINT` asks for one.
    traces: Option<Traces>,
}

impl std::fmt::Debug for Application {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Application")
            .field("port", &self.port)
            .field("mode", &self.description)
            .finish_non_exhaustive()
    }
}

/// What [`lanes`] wires: each lane's parts, the downstream budgets both draw on (the dashboard
/// shows them and resumes through them) and the run history both write to.
struct Lanes {
    high: LaneParts,
    low: LaneParts,
    budgets: Budgets,
    history: Option<History>,
}

/// Each lane's queues and record runner over the wiring's lock and markers, both runners
/// drawing on one set of downstream budgets, writing to one run history (if on) and telling
/// [`crate::recent`] of every outcome.
fn lanes(wiring: &Wiring, logic: Arc<dyn Logic>, settings: &Settings) -> Lanes {
    let budgets = Budgets::new(wiring.budgets.clone(), settings.budget.clone());
    let history = wiring.history.clone().map(|store| {
        History::new(
            store,
            HistoryOptions {
                keep: settings
                    .history
                    .as_ref()
                    .map_or(HistoryOptions::default().keep, |h| h.keep),
                instance: settings.lease.holder.clone(),
                ..HistoryOptions::default()
            },
        )
    });
    let lane = |queue: &Arc<dyn TriggerQueue>, poison: &Arc<dyn TriggerQueue>, lane: Lane| {
        let mut runner = RecordRunner::shipped(
            wiring.lock.clone(),
            wiring.markers.clone(),
            queue.clone(),
            logic.clone(),
            settings.runner.clone(),
            &budgets,
            lane,
        )
        .with_outcome_sink(crate::recent::sink());
        if let Some(history) = &history {
            runner = runner.with_history(history.clone());
        }
        LaneParts {
            queue: queue.clone(),
            poison: poison.clone(),
            runner,
        }
    };
    Lanes {
        high: lane(&wiring.queue, &wiring.poison, Lane::High),
        low: lane(&wiring.low_queue, &wiring.low_poison, Lane::Low),
        budgets,
        history,
    }
}

/// Says at the start where run history goes (the Table endpoint's URL only: no query, so no
/// SAS), or why it is off when it was not turned off.
fn log_history(settings: &Settings) {
    match (&settings.history, &settings.history_off) {
        (_, Some(why)) => tracing::warn!("{why}"),
        (Some(history), None) => tracing::info!(
            table_endpoint = %settings.account.table_endpoint().unwrap_or_default(),
            tables = %history.table_prefix,
            days = history.keep.as_secs() / 86_400,
            "run history on"
        ),
        (None, None) => tracing::info!("run history off (LEASEHOLD_HISTORY=false)"),
    }
}

/// How often an instance drops the history tables past their days (every instance does; a
/// table already dropped costs the others a list request and nothing more).
const HISTORY_SWEEP_EVERY: Duration = Duration::from_secs(3600);

/// The longest a stopping process waits for its last history entries to be written.
const HISTORY_FLUSH_AT_STOP: Duration = Duration::from_secs(5);

/// Drops the history's old tables a minute after the start and then every
/// [`HISTORY_SWEEP_EVERY`], until `shutdown`.
async fn sweep_history(history: History, shutdown: CancellationToken) {
    let mut next = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
        next += HISTORY_SWEEP_EVERY;
        let keep = history.options().keep;
        match history.store().sweep(keep).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                tables = n,
                keep_days = keep.as_secs() / 86_400,
                "dropped run history older than its days"
            ),
            Err(e) => tracing::warn!(error = %e, "could not drop old run history; trying again in an hour"),
        }
    }
}

/// The metrics task over the wiring's queues.
fn sampler(wiring: &Wiring, settings: &Settings, log_event: bool) -> Sampler {
    Sampler {
        queue: wiring.queue.clone(),
        poison: wiring.poison.clone(),
        low_queue: wiring.low_queue.clone(),
        low_poison: wiring.low_poison.clone(),
        interval: settings.metrics_interval,
        log_event,
    }
}

impl Application {
    /// Builds `mode` from `settings`. A logic command is supervised by this executable's hidden
    /// `supervise` subcommand (see [`build_with_supervisor`](Self::build_with_supervisor) when
    /// the running executable is not `leasehold`, as in tests).
    pub async fn build(settings: Settings, mode: Mode) -> Result<Self> {
        Self::build_with_supervisor(settings, mode, None).await
    }

    /// [`build`](Self::build), with logic commands supervised by the `leasehold` executable at
    /// `supervisor` (`None`: the running executable).
    pub async fn build_with_supervisor(
        settings: Settings,
        mode: Mode,
        supervisor: Option<PathBuf>,
    ) -> Result<Self> {
        telemetry::init();
        let traces = crate::traces::install()?;
        log_history(&settings);
        let mut app = match mode {
            Mode::Handler => Self::handler(settings, supervisor).await,
            Mode::Standalone { port, demo } => Self::standalone(settings, port, demo, supervisor).await,
        }?;
        app.traces = traces;
        Ok(app)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port of the health listener, when `LEASEHOLD_HEALTH_PORT` is set.
    pub fn health_port(&self) -> Option<u16> {
        self.health
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port())
    }

    /// Serves until `stop` fires, then stops taking work and hands back what is in flight
    /// (standalone: runs get the shutdown grace; the custom handler: the host's own drain).
    pub async fn run_until_stopped(self, stop: CancellationToken) -> Result<()> {
        let shutdown = self.shutdown.clone();
        let link = tokio::spawn(async move {
            stop.cancelled().await;
            shutdown.cancel();
        });
        let sampler = tokio::spawn(self.sampler.run(self.shutdown.clone()));
        let sweep = self
            .history
            .clone()
            .map(|history| tokio::spawn(sweep_history(history, self.shutdown.clone())));
        let health = self
            .health
            .map(|listener| tokio::spawn(server::serve_health(listener, self.shutdown.clone())));
        let http = server::serve(self.listener, self.router, &self.http, self.shutdown.clone());
        match self.consumer {
            Some(consumer) => {
                let consume = consumer.run(self.shutdown.clone());
                tokio::join!(http, consume);
            }
            None => http.await,
        }
        link.abort();
        // What the last runs wrote, in storage before the process ends.
        if let Some(history) = &self.history
            && tokio::time::timeout(HISTORY_FLUSH_AT_STOP, history.flush())
                .await
                .is_err()
        {
            tracing::warn!(
                "the last run history entries were not written within {HISTORY_FLUSH_AT_STOP:?}; going on stopping"
            );
        }
        // They stop at the shutdown, at their next await.
        let _ = sampler.await;
        if let Some(sweep) = sweep {
            let _ = sweep.await;
        }
        if let Some(health) = health {
            let _ = health.await;
        }
        if let Some(traces) = self.traces {
            traces.shutdown(TRACES_FLUSH_AT_STOP).await;
        }
        tracing::info!(mode = %self.description, "stopped");
        Ok(())
    }

    /// The HTTP limits of `settings`, the connection bound capped to the descriptor limit
    /// (logged when that lowered it).
    fn http_options(settings: &Settings) -> HttpOptions {
        let (bound, lowered) = server::connection_bound(
            settings.http.max_connections,
            server::descriptor_limit(),
            settings.consumer.concurrency,
        );
        if let Some(why) = lowered {
            tracing::warn!(max_connections = bound, "{why}");
        }
        HttpOptions {
            max_connections: bound,
            ..settings.http.clone()
        }
    }

    async fn handler(settings: Settings, supervisor: Option<PathBuf>) -> Result<Self> {
        let port = settings.handler_port.context(
            "FUNCTIONS_CUSTOMHANDLER_PORT is not set: the Functions host sets it when it starts a custom handler",
        )?;
        // Listen first: the host gives a custom handler at most 30 s to answer GET /.
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .with_context(|| format!("listening on 127.0.0.1:{port}"))?;
        let port = listener.local_addr()?.port();
        let wiring = wire(&settings.storage())?;
        // Under the host a logic command runs in the app root (where the executable is), so one
        // packed beside it (`logic/…`) is named relative to it.
        let logic = logic(&settings, false, supervisor, app_root())?;
        // In the background: the host gives GET / 30 s at most, and storage may be slow.
        tokio::spawn(ensure_resources(&settings));
        let shutdown = CancellationToken::new();
        let Lanes {
            high,
            low,
            budgets,
            history,
        } = lanes(&wiring, logic, &settings);
        let sampler = sampler(&wiring, &settings, true);
        let app = App {
            policy: settings.policy.clone(),
            high,
            low,
            wake: None,
            shutdown: shutdown.clone(),
            body_timeout: settings.http.body_timeout,
        };
        // The host runs up to its own concurrency of invocations at once (plus its probes).
        let http = Self::http_options(&settings);
        tracing::info!(port, queue = %settings.queue, container = %settings.container,
            max_connections = http.max_connections, "custom handler listening");
        // The dashboard's functions (Dashboard, Ops): the handler checks LEASEHOLD_ADMIN_KEY for
        // Ops itself (every local process can reach its port, not only the host).
        let dashboard = admin::handler_router(
            admin::Backend::new(Operator::new(&settings.storage())?, Some(budgets)),
            settings.admin_key.clone(),
            settings.http.body_timeout,
        );
        Ok(Self {
            listener,
            port,
            health: None,
            shutdown,
            // Its port is loopback's: a page in a developer's browser (under `func start`) must
            // not reach it.
            router: handler_router(app)
                .merge(dashboard)
                .layer(axum::middleware::from_fn(
                    leasehold_functions::http::refuse_web_pages,
                )),
            consumer: None,
            description: "custom handler".into(),
            http,
            sampler,
            history,
            traces: None,
        })
    }

    async fn standalone(
        settings: Settings,
        port: Option<u16>,
        demo: bool,
        supervisor: Option<PathBuf>,
    ) -> Result<Self> {
        let wiring = wire(&settings.storage())?;
        let logic = logic(&settings, demo, supervisor, None)?;
        ensure_resources(&settings).await;
        // Fail fast on unusable credentials or endpoints, with the storage answer (a peek: a
        // message-level read, which every role that can run Leasehold may make).
        if let Err(e) = wiring.queue.peek(1).await {
            if e.is_transient() {
                tracing::warn!(error = %e, "storage is not answering yet; the consumer will keep trying");
            } else {
                bail!("the storage account refused a request ({e}); check AzureWebJobsStorage");
            }
        }
        let port = port.unwrap_or(settings.port);
        let listener = TcpListener::bind((settings.bind.as_str(), port))
            .await
            .with_context(|| {
                format!(
                    "listening on {}:{port} (LEASEHOLD_BIND, LEASEHOLD_PORT)",
                    settings.bind
                )
            })?;
        let addr = listener.local_addr()?;
        let health = match settings.health_port {
            Some(port) => Some(
                TcpListener::bind((settings.bind.as_str(), port))
                    .await
                    .with_context(|| {
                        format!(
                            "listening on {}:{port} for the liveness probe (LEASEHOLD_BIND, LEASEHOLD_HEALTH_PORT)",
                            settings.bind
                        )
                    })?,
            ),
            None => None,
        };
        if let Some(health) = &health {
            tracing::info!(addr = %health.local_addr()?, "serving GET /healthz for the liveness probe");
        }
        if settings.policy.api_key.is_none() && !addr.ip().is_loopback() {
            if !settings.insecure_no_start_key {
                bail!(
                    "refusing to serve Start on {addr} without a key: LEASEHOLD_BIND={} is not a loopback \
                     address, so anyone who can reach it could trigger runs. Set LEASEHOLD_API_KEY (callers \
                     send it as the x-functions-key header or the code query parameter), or bind 127.0.0.1, \
                     or, if something in front of it authenticates callers, set \
                     LEASEHOLD_INSECURE_NO_START_KEY=true (or pass `serve --insecure-no-start-key`)",
                    settings.bind
                );
            }
            tracing::warn!(%addr, "Start is open to anyone who can reach {addr}: no LEASEHOLD_API_KEY, and LEASEHOLD_INSECURE_NO_START_KEY is set");
        }
        // A keyless Start refuses web pages where it is a loopback endpoint; beyond loopback
        // (LEASEHOLD_INSECURE_NO_START_KEY) a front end answers under its public name.
        let mut policy = settings.policy.clone();
        policy.refuse_web_pages = addr.ip().is_loopback();
        let shutdown = CancellationToken::new();
        let Lanes {
            high,
            low,
            budgets,
            history,
        } = lanes(&wiring, logic, &settings);
        let consumer = Consumer::new(
            high.runner.clone(),
            high.poison.clone(),
            settings.consumer.clone(),
        )
        .with_low_lane(low.runner.clone(), low.poison.clone());
        let sampler = sampler(&wiring, &settings, false);
        let app = App {
            policy: policy.clone(),
            high,
            low,
            wake: Some(consumer.waker()),
            shutdown: shutdown.clone(),
            body_timeout: settings.http.body_timeout,
        };
        let http = Self::http_options(&settings);
        tracing::info!(%addr, queue = %settings.queue, container = %settings.container,
            concurrency = settings.consumer.concurrency, max_connections = http.max_connections,
            "serving POST /api/start and consuming the queue");
        // GET /metrics, behind Start's key.
        let router = standalone_router(app).merge(telemetry::router(policy));
        let router = match &settings.admin_key {
            Some(key) => {
                let operator = Operator::new(&settings.storage())?;
                tracing::info!(url = %format!("http://{addr}{}", admin::PAGE_PATH),
                    "dashboard on (its key: LEASEHOLD_ADMIN_KEY, sent as the {} header)", admin::KEY_HEADER);
                router.merge(admin::serve_router(
                    admin::Backend::new(operator, Some(budgets)),
                    key.clone(),
                    settings.http.body_timeout,
                ))
            }
            None => {
                tracing::info!(
                    "dashboard off: set LEASEHOLD_ADMIN_KEY (a key of its own, not LEASEHOLD_API_KEY) to serve it at {}",
                    admin::PAGE_PATH
                );
                router
            }
        };
        Ok(Self {
            listener,
            port: addr.port(),
            health,
            shutdown,
            router,
            consumer: Some(consumer),
            description: "standalone".into(),
            http,
            sampler,
            history,
            traces: None,
        })
    }
}

/// Creates the trigger queue, the poison queue and the container if they are missing, so a
/// producer that puts messages itself (the wire format is documented) finds the queue there; and
/// says at once, as an error, if the blob account cannot hold the lock blobs (page blobs).
/// Credentials that may not create them (an identity with a data-only role, a SAS without
/// container-level rights) are told apart from an outage, said so once, and start-up goes on:
/// someone with the rights may have created them already, and each is created on first use
/// where the credentials allow.
pub(crate) fn ensure_resources(settings: &Settings) -> impl Future<Output = ()> + Send + 'static {
    let counters = OpCounters::new();
    let low = low_queue_name(&settings.queue);
    let queues: Vec<(&'static str, String)> = vec![
        ("trigger queue", settings.queue.clone()),
        ("poison queue", poison_queue_name(&settings.queue)),
        ("low lane's trigger queue", low.clone()),
        ("low lane's poison queue", poison_queue_name(&low)),
    ];
    let queues: Vec<(&'static str, String, AzureQueue)> = queues
        .into_iter()
        .map(|(what, name)| {
            let queue = AzureQueue::new(&settings.account, &name, counters.clone());
            (what, name, queue)
        })
        .collect();
    let container = BlobContainer::new(&settings.account, &settings.container, counters);
    let container_name = settings.container.clone();
    async move { ensure(queues, container, container_name).await }
}

async fn ensure(
    queues: Vec<(&'static str, String, AzureQueue)>,
    container: BlobContainer,
    container_name: String,
) {
    let (queue_results, c, kind) = tokio::join!(
        futures::future::join_all(queues.iter().map(|(_, _, q)| q.create())),
        container.create(),
        container.account_kind()
    );
    match kind {
        Ok(Some(kind)) if !leasehold_storage::azure::holds_page_blobs(kind) => tracing::error!(
            account_kind = kind,
            "the blob account is a {kind} account, which holds no page blobs: Leasehold's lock blobs are \
             page blobs, so no record can run here; use a general-purpose v2 account (StorageV2) for \
             the blob service"
        ),
        Ok(_) => {}
        // Not every credential may read the account's information: the first lock says.
        Err(e) => tracing::debug!(error = %e, "could not read the storage account's kind"),
    }
    let mut created = Vec::new();
    let results = queues
        .iter()
        .zip(queue_results)
        .map(|((what, name, _), result)| (*what, name.as_str(), result))
        .chain(std::iter::once(("container", container_name.as_str(), c)));
    for (what, name, result) in results {
        match result {
            Ok(()) => created.push(name),
            Err(e) if matches!(e.status(), Some(401 | 403)) => tracing::warn!(
                resource = what, name, error = %e,
                "cannot create the {what} {name} with these credentials (they may read and write but not create); \
                 if it does not exist yet, create it (or grant a role that may, such as Storage Queue Data \
                 Contributor / Storage Blob Data Contributor) — going on"
            ),
            Err(e) => tracing::warn!(
                resource = what, name, error = %e,
                "could not make sure the {what} {name} exists; it is created on first use — going on"
            ),
        }
    }
    if !created.is_empty() {
        tracing::info!(resources = ?created, "storage resources are in place");
    }
}

/// The directory of the running executable: the Function App's root under the host.
fn app_root() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(PathBuf::from)
}

fn logic(
    settings: &Settings,
    demo: bool,
    supervisor: Option<PathBuf>,
    app_root: Option<PathBuf>,
) -> Result<Arc<dyn Logic>> {
    Ok(match &settings.logic {
        LogicSetting::Command(c) => command_logic(
            c,
            &settings.logic_env,
            settings.runner.stop_grace,
            supervisor,
            app_root,
        )?,
        LogicSetting::Url(u) => Arc::new(
            UrlLogic::new(u, settings.runner.run_timeout)
                .map_err(|e| anyhow::anyhow!("LEASEHOLD_LOGIC_URL: {e}"))?,
        ),
        LogicSetting::Demo(d) => Arc::new(DemoLogic { duration: *d }),
        LogicSetting::Unset if demo => Arc::new(DemoLogic {
            duration: Duration::from_secs(2),
        }),
        LogicSetting::Unset => bail!(
            "no logic to run: set LEASEHOLD_LOGIC_COMMAND (a shell command) or LEASEHOLD_LOGIC_URL (an HTTP endpoint), \
             or pass --demo to `serve`"
        ),
    })
}

/// A shell command, supervised by the `leasehold` executable's `supervise` subcommand. Its
/// SIGTERM → SIGKILL grace ends a second inside the runner's stop grace, so a cancelled command
/// is dead before the runner gives up waiting (and before the lease can be handed on).
#[cfg(unix)]
fn command_logic(
    command: &str,
    allowed_env: &[String],
    stop_grace: Duration,
    supervisor: Option<PathBuf>,
    app_root: Option<PathBuf>,
) -> Result<Arc<dyn Logic>> {
    use leasehold_functions::logic::{CommandEnv, CommandLogic, Supervisor};
    let supervisor = match supervisor {
        Some(path) => Supervisor::program(path, ["supervise"]),
        None => Supervisor::current_exe()
            .context("LEASEHOLD_LOGIC_COMMAND: locating the leasehold executable (its supervisor)")?,
    };
    let grace = stop_grace
        .saturating_sub(Duration::from_secs(1))
        .max(Duration::from_millis(500));
    // The command gets the base variables and those the settings allow, with this process's
    // values (read now: the warnings about them are start-up's).
    let env = CommandEnv::from_vars(std::env::vars_os(), allowed_env);
    let logic = CommandLogic::new(command, supervisor)
        .with_env(env)
        .with_grace(grace);
    Ok(Arc::new(match app_root {
        Some(root) => logic.with_app_root(root),
        None => logic,
    }))
}

#[cfg(not(unix))]
fn command_logic(
    _command: &str,
    _allowed_env: &[String],
    _stop_grace: Duration,
    _supervisor: Option<PathBuf>,
    _app_root: Option<PathBuf>,
) -> Result<Arc<dyn Logic>> {
    bail!("LEASEHOLD_LOGIC_COMMAND needs a Unix system; use LEASEHOLD_LOGIC_URL")
}
