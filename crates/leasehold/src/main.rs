//! `leasehold`: the executable. Configuration, telemetry, signals and wiring only; everything
//! testable lives in the libraries.

mod settings;

use std::ffi::OsString;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use leasehold_functions::http::{App, handler_router, standalone_router};
use leasehold_functions::logic::{DemoLogic, UrlLogic};
use leasehold_lock::azure::AzureBlobStore;
use leasehold_lock::{LeaseLock, OpCounters, RetryOptions};
use leasehold_runtime::{
    AzureQueue, Consumer, Logic, RecordRunner, TriggerMessage, TriggerQueue, marker_blob_name,
    poison_queue_name, record_key,
};
use tokio_util::sync::CancellationToken;

use crate::settings::{LogicSetting, Settings};

/// Long per-record work on Azure: one run per record at a time, every event honoured, bursts
/// coalesced into one follow-up run, recovery from crashes in about a minute.
///
/// Settings come from the environment (AzureWebJobsStorage, LEASEHOLD_*); see the README.
#[derive(Debug, Parser)]
#[command(name = "leasehold", version, about, long_about)]
struct Cli {
    /// Log format.
    #[arg(
        long,
        env = "LEASEHOLD_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run as an Azure Functions custom handler (chosen automatically when
    /// FUNCTIONS_CUSTOMHANDLER_PORT is set): serves GET /, POST /Start and POST /Worker on
    /// 127.0.0.1:$FUNCTIONS_CUSTOMHANDLER_PORT.
    Handler,
    /// Run standalone: the Start endpoint (POST /api/start) and a queue consumer in one process.
    Serve {
        /// Port for the Start endpoint [env: LEASEHOLD_PORT; default 7071].
        #[arg(long)]
        port: Option<u16>,
        /// Run the demo logic (logs and waits LEASEHOLD_DEMO_SECONDS, default 2) when no
        /// LEASEHOLD_LOGIC_COMMAND or LEASEHOLD_LOGIC_URL is set.
        #[arg(long)]
        demo: bool,
    },
    /// Put a trigger for a record on the queue (as Start would).
    Enqueue {
        /// Scope of the record (e.g. a Dataverse table name).
        #[arg(long, default_value = "default")]
        scope: String,
        record_id: String,
    },
    /// Show a record's lease (held, holder, since, fencing generation), whether a retrigger is
    /// pending, and the queue and poison queue depths.
    Status {
        #[arg(long, default_value = "default")]
        scope: String,
        /// Omit to see only the queue depths.
        record_id: Option<String>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Break a record's lease: its run is told at its next renewal and stops; the record is free
    /// once that run released it or its lease would have expired (or at once with --now).
    Break {
        #[arg(long, default_value = "default")]
        scope: String,
        record_id: String,
        /// Why (logged).
        #[arg(long)]
        reason: String,
        /// Free the record at once instead of when the broken lease would have expired. Only
        /// for a holder known to be dead: a live one may still be running when the next starts.
        #[arg(long)]
        now: bool,
    },
    /// Internal: runs a logic command in a process group of its own and stops the whole group
    /// on SIGTERM/SIGINT/SIGHUP, on a `stop` line or end of stdin, and when the command exits.
    /// The worker starts it for every LEASEHOLD_LOGIC_COMMAND run.
    #[command(hide = true)]
    Supervise {
        /// Milliseconds between SIGTERM and SIGKILL when told to stop.
        #[arg(long)]
        grace_ms: u64,
        /// The program and its arguments (after `--`).
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<OsString>,
    },
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,azure_core=warn,reqwest=warn,hyper=warn")
    });
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The supervisor of a logic command runs without the async runtime and without logging.
    if let Some(Command::Supervise { grace_ms, command }) = cli.command {
        return supervise(grace_ms, command);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("leasehold: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    init_tracing(cli.log_format);
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasehold: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(unix)]
fn supervise(grace_ms: u64, mut command: Vec<OsString>) -> std::process::ExitCode {
    let program = command.remove(0);
    leasehold_functions::logic::supervise(leasehold_functions::logic::SuperviseArgs {
        grace: Duration::from_millis(grace_ms),
        program,
        args: command,
    })
}

#[cfg(not(unix))]
fn supervise(_grace_ms: u64, _command: Vec<OsString>) -> std::process::ExitCode {
    eprintln!("leasehold supervise: needs a Unix system");
    std::process::ExitCode::from(125)
}

async fn run(cli: Cli) -> Result<()> {
    let command = match cli.command {
        Some(c) => c,
        None if std::env::var_os("FUNCTIONS_CUSTOMHANDLER_PORT").is_some()
            || std::env::var_os("FUNCTIONS_HTTPWORKER_PORT").is_some() =>
        {
            Command::Handler
        }
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            return Ok(());
        }
    };
    let settings = Settings::from_env()?;
    match command {
        Command::Handler => handler(settings).await,
        Command::Serve { port, demo } => serve(settings, port, demo).await,
        Command::Enqueue { scope, record_id } => enqueue(settings, &scope, &record_id).await,
        Command::Status {
            scope,
            record_id,
            json,
        } => status(settings, &scope, record_id.as_deref(), json).await,
        Command::Break {
            scope,
            record_id,
            reason,
            now,
        } => break_lease(settings, &scope, &record_id, &reason, now).await,
        Command::Supervise { .. } => bail!("`supervise` runs before the async runtime starts"),
    }
}

/// Queues, lock and runner from the settings, sharing one set of round-trip counters.
struct Wiring {
    queue: Arc<dyn TriggerQueue>,
    poison: Arc<dyn TriggerQueue>,
    lock: LeaseLock,
}

fn wire(settings: &Settings) -> Result<Wiring> {
    let counters = OpCounters::new();
    let store = Arc::new(AzureBlobStore::new(
        &settings.account,
        &settings.container,
        counters.clone(),
    ));
    let lock = LeaseLock::new(store, settings.lease.clone())?;
    Ok(Wiring {
        queue: Arc::new(AzureQueue::new(
            &settings.account,
            &settings.queue,
            counters.clone(),
        )),
        poison: Arc::new(AzureQueue::new(
            &settings.account,
            &poison_queue_name(&settings.queue),
            counters,
        )),
        lock,
    })
}

fn logic(settings: &Settings, demo: bool) -> Result<Arc<dyn Logic>> {
    Ok(match &settings.logic {
        LogicSetting::Command(c) => command_logic(c, settings.runner.stop_grace)?,
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

/// A shell command, supervised by this executable's `supervise` subcommand. Its SIGTERM →
/// SIGKILL grace ends a second inside the runner's stop grace, so a cancelled command is dead
/// before the runner gives up waiting (and before the lease can be handed on).
#[cfg(unix)]
fn command_logic(command: &str, stop_grace: Duration) -> Result<Arc<dyn Logic>> {
    use leasehold_functions::logic::{CommandLogic, Supervisor};
    let supervisor = Supervisor::current_exe()
        .context("LEASEHOLD_LOGIC_COMMAND: locating the leasehold executable (its supervisor)")?;
    let grace = stop_grace
        .saturating_sub(Duration::from_secs(1))
        .max(Duration::from_millis(500));
    Ok(Arc::new(CommandLogic::new(command, supervisor).with_grace(grace)))
}

#[cfg(not(unix))]
fn command_logic(_command: &str, _stop_grace: Duration) -> Result<Arc<dyn Logic>> {
    bail!("LEASEHOLD_LOGIC_COMMAND needs a Unix system; use LEASEHOLD_LOGIC_URL")
}

/// Fires on SIGINT or SIGTERM.
fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = ctrl_c => tracing::info!("SIGINT: shutting down"),
            _ = term => tracing::info!("SIGTERM: shutting down"),
        }
        t.cancel();
    });
    token
}

async fn handler(settings: Settings) -> Result<()> {
    let port = settings.handler_port.context(
        "FUNCTIONS_CUSTOMHANDLER_PORT is not set: the Functions host sets it when it starts a custom handler",
    )?;
    // Listen first: the host gives a custom handler at most 30 s to answer GET /.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .with_context(|| format!("listening on 127.0.0.1:{port}"))?;
    let wiring = wire(&settings)?;
    let logic = logic(&settings, false)?;
    let shutdown = shutdown_signal();
    let runner = RecordRunner::new(wiring.lock, wiring.queue.clone(), logic, settings.runner.clone());
    let app = App {
        policy: settings.policy.clone(),
        queue: wiring.queue,
        poison: wiring.poison,
        runner,
        wake: None,
        shutdown: shutdown.clone(),
    };
    tracing::info!(port, queue = %settings.queue, container = %settings.container, "custom handler listening");
    axum::serve(listener, handler_router(app))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    tracing::info!("custom handler stopped");
    Ok(())
}

async fn serve(settings: Settings, port: Option<u16>, demo: bool) -> Result<()> {
    let wiring = wire(&settings)?;
    let logic = logic(&settings, demo)?;
    // Fail fast on unusable credentials or endpoints, with the storage answer.
    if let Err(e) = wiring.queue.approximate_len().await {
        if e.is_transient() {
            tracing::warn!(error = %e, "storage is not answering yet; the consumer will keep trying");
        } else {
            bail!("the storage account refused a request ({e}); check AzureWebJobsStorage");
        }
    }
    let port = port.unwrap_or(settings.port);
    let listener = tokio::net::TcpListener::bind((settings.bind.as_str(), port))
        .await
        .with_context(|| {
            format!(
                "listening on {}:{port} (LEASEHOLD_BIND, LEASEHOLD_PORT)",
                settings.bind
            )
        })?;
    let shutdown = shutdown_signal();
    let runner = RecordRunner::new(wiring.lock, wiring.queue.clone(), logic, settings.runner.clone());
    let consumer = Consumer::new(runner.clone(), wiring.poison.clone(), settings.consumer.clone());
    let app = App {
        policy: settings.policy.clone(),
        queue: wiring.queue,
        poison: wiring.poison,
        runner,
        wake: Some(consumer.waker()),
        shutdown: shutdown.clone(),
    };
    let addr = listener.local_addr()?;
    tracing::info!(%addr, queue = %settings.queue, container = %settings.container,
        concurrency = settings.consumer.concurrency, "serving POST /api/start and consuming the queue");
    let http = axum::serve(listener, standalone_router(app))
        .with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let consume = consumer.run(shutdown.clone());
    let (served, ()) = tokio::join!(async { http.await }, consume);
    served?;
    Ok(())
}

fn message_for(scope: &str, record_id: &str) -> Result<TriggerMessage> {
    let scope =
        leasehold_functions::start::normalise_scope(scope).map_err(|e| anyhow::anyhow!("--scope: {e}"))?;
    let record_id = leasehold_functions::start::normalise_record_id(record_id)
        .map_err(|e| anyhow::anyhow!("record id: {e}"))?;
    Ok(TriggerMessage::new(scope, record_id))
}

async fn enqueue(settings: Settings, scope: &str, record_id: &str) -> Result<()> {
    let message = message_for(scope, record_id)?;
    let wiring = wire(&settings)?;
    let body = message.encode();
    RetryOptions::default()
        .run("enqueue", || wiring.queue.put(&body, Duration::ZERO))
        .await?;
    println!(
        "enqueued {}/{} on {}",
        message.scope, message.record_id, settings.queue
    );
    Ok(())
}

async fn status(settings: Settings, scope: &str, record_id: Option<&str>, json: bool) -> Result<()> {
    let wiring = wire(&settings)?;
    let depth = wiring.queue.approximate_len().await?;
    let poison = wiring.poison.approximate_len().await?;
    let mut report = serde_json::json!({
        "queue": { "name": settings.queue, "approximateMessages": depth },
        "poison": { "name": poison_queue_name(&settings.queue), "approximateMessages": poison },
    });
    if let Some(record_id) = record_id {
        let message = message_for(scope, record_id)?;
        let key = record_key(&message.scope, &message.record_id).map_err(anyhow::Error::msg)?;
        let info = wiring.lock.inspect(&key).await?;
        let pending = wiring.lock.store().flag_exists(&marker_blob_name(&key)).await?;
        let since = info
            .since
            .map(|t| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()));
        report["record"] = serde_json::json!({
            "scope": message.scope,
            "recordId": message.record_id,
            "held": info.held,
            "leaseState": info.state.map(|s| format!("{s:?}").to_lowercase()),
            "holder": info.holder,
            "sinceUnixSeconds": since,
            "generation": info.generation,
            "retriggerPending": pending,
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if let Some(r) = report.get("record") {
        println!(
            "record      {}/{}",
            r["scope"].as_str().unwrap_or(""),
            r["recordId"].as_str().unwrap_or("")
        );
        let held = if r["held"].as_bool() == Some(true) {
            "held"
        } else {
            "free"
        };
        let state = r["leaseState"].as_str().unwrap_or("never used");
        println!("lease       {held} ({state})");
        if let Some(holder) = r["holder"].as_str() {
            println!(
                "holder      {holder} (last fenced grant, {} s since the epoch)",
                r["sinceUnixSeconds"]
            );
        }
        println!("generation  {}", r["generation"]);
        println!(
            "retrigger   {}",
            if r["retriggerPending"].as_bool() == Some(true) {
                "pending"
            } else {
                "none"
            }
        );
    }
    println!("queue       {}: about {depth} messages", settings.queue);
    println!(
        "poison      {}: about {poison} messages",
        poison_queue_name(&settings.queue)
    );
    Ok(())
}

async fn break_lease(
    settings: Settings,
    scope: &str,
    record_id: &str,
    reason: &str,
    now: bool,
) -> Result<()> {
    let message = message_for(scope, record_id)?;
    let key = record_key(&message.scope, &message.record_id).map_err(anyhow::Error::msg)?;
    let wiring = wire(&settings)?;
    if now {
        wiring.lock.break_lock_after(&key, reason, Duration::ZERO).await?;
        println!("broke the lease on {key} ({reason}); the record is free now");
    } else {
        wiring.lock.break_lock(&key, reason).await?;
        println!(
            "broke the lease on {key} ({reason}); its run is told at its next renewal, and the record is free once \
             that run released it or the lease would have expired (at most {} s)",
            settings.lease.duration.as_secs()
        );
    }
    Ok(())
}
