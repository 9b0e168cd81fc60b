//! `leasehold`: the executable. The command line, logging and signals only; the application
//! is the `leasehold` library (`src/lib.rs`).

use std::ffi::OsString;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use leasehold::{Application, Mode, Settings, ops};
use leasehold_runtime::{RecordId, Scope};
use tokio_util::sync::CancellationToken;

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
        /// Serve Start without a key on a non-loopback address (LEASEHOLD_BIND), which `serve`
        /// otherwise refuses: anyone who can reach it can trigger runs. Only for when something
        /// in front of it authenticates callers [env: LEASEHOLD_INSECURE_NO_START_KEY].
        #[arg(long)]
        insecure_no_start_key: bool,
    },
    /// Put a trigger for a record on the queue (as Start would).
    #[command(
        after_help = "Example:\n  leasehold enqueue --scope account 8f9c1d2e-0000-4000-8000-000000000001"
    )]
    Enqueue {
        /// Scope of the record (e.g. a Dataverse table name).
        #[arg(long, default_value = "default")]
        scope: Scope,
        record_id: RecordId,
    },
    /// The system at a glance: held records (holder, since, fencing generation, lease state),
    /// records with a retrigger pending, queue and poison depths and the age of the oldest
    /// message. With a record: that record's lease and retrigger marker.
    ///
    /// Without a record it lists the lock blobs with their lease state and metadata: one
    /// storage request per 5,000 records that ever ran (use --scope to narrow it), plus four
    /// queue requests.
    #[command(
        after_help = "Examples:\n  leasehold status\n  leasehold status --scope account --limit 20\n  \
        leasehold status --scope account 8f9c1d2e-0000-4000-8000-000000000001\n  leasehold status --json | jq .heldCount"
    )]
    Status {
        /// Only this scope (with a record: the record's scope; default "default").
        #[arg(long)]
        scope: Option<Scope>,
        /// Omit to see the whole system.
        record_id: Option<RecordId>,
        /// Show at most this many held records and pending retriggers.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Show held records after this scope/record (the `--after` a previous page printed).
        #[arg(long)]
        after: Option<String>,
        /// Print JSON (RFC 3339 times) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Look at and act on the poison queue: triggers given up, with the reason.
    #[command(subcommand)]
    Poison(PoisonCommand),
    /// Break a record's lease: its run is told at its next renewal and stops; the record is free
    /// once that run released it or its lease would have expired (or at once with --now).
    #[command(
        after_help = "Example:\n  leasehold break --scope account 8f9c1d2e-0000-4000-8000-000000000001 --reason \"stuck on a dead VM\""
    )]
    Break {
        #[arg(long, default_value = "default")]
        scope: Scope,
        record_id: RecordId,
        /// Why (logged).
        #[arg(long)]
        reason: String,
        /// Free the record at once instead of when the broken lease would have expired. Only
        /// for a holder known to be dead: a live one may still be running when the next starts.
        #[arg(long)]
        now: bool,
    },
    /// Wire a Dataverse (Dynamics 365) environment to Start: register, list, unregister the
    /// webhook and its steps.
    #[command(subcommand)]
    Dataverse(leasehold::dataverse::DataverseCommand),
    /// Internal: runs a logic command in a process group of its own and stops the whole group
    /// on SIGTERM/SIGINT/SIGHUP, on a `stop` line or end of stdin, and when the command exits.
    /// Run `leasehold ARGS` as a container's PID 1 (the image's entrypoint: `leasehold init --
    /// serve`): forwards signals to it, reaps orphans, exits as it does. Unlike tini it is
    /// non-dumpable, so a logic command cannot read the container's secrets from PID 1.
    #[cfg(unix)]
    #[command(
        after_help = "Example (a container's entrypoint):\n  ENTRYPOINT [\"leasehold\", \"init\", \"--\"]\n  CMD [\"serve\"]"
    )]
    Init {
        /// The leasehold subcommand and its arguments (after `--`).
        #[arg(last = true, required = true, num_args = 1..)]
        args: Vec<OsString>,
    },
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

#[derive(Debug, Subcommand)]
enum PoisonCommand {
    /// List poison entries, oldest first: record, reason, attempts, when given up; and per
    /// record the first and last time it was given up.
    ///
    /// Up to 32 entries are peeked, with no side effect. More (--limit over 32) are scanned:
    /// taken 32 at a time and put back at the end, hidden from other readers meanwhile (30 s at
    /// a time, hidden again while the scan runs: if it dies, they are back within 30 s; Ctrl-C
    /// puts them back at once). A scan holds at most 10,000 entries.
    ///
    /// Reasons and bodies are printed with control characters escaped (`\u{1b}`); --json
    /// carries them exactly. A listing holds the first 512 bytes of each reason; `show` prints
    /// it whole.
    #[command(after_help = "Examples:\n  leasehold poison list\n  leasehold poison list --limit 500 --json")]
    List {
        /// Show at most this many entries (at most 10,000).
        #[arg(long, default_value_t = 32)]
        limit: usize,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show one entry in full.
    #[command(after_help = "Example:\n  leasehold poison show 7c0e9a4e-1f52-4c2b-9d43-3f0d6f0e2a11")]
    Show {
        /// The entry's id (from `poison list`).
        id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Requeue entries as fresh triggers (a new chain with no attempts behind it): the trigger
    /// is put on the queue first and the entry removed only after, so an interruption leaves
    /// it in both places, never in neither.
    ///
    /// It ends by comparing the poison queue's approximate count (hidden entries included) with
    /// what it left there: if entries remain that it could not see (another scan holds them), it
    /// says "incomplete: N hidden, run again after T" and exits with status 3. Ctrl-C stops it
    /// between entries and puts back what it holds (exit status 130).
    #[command(
        after_help = "Examples:\n  leasehold poison requeue 7c0e9a4e-1f52-4c2b-9d43-3f0d6f0e2a11\n  \
        leasehold poison requeue --scope account\n  leasehold poison requeue --scope account --record 42\n  \
        leasehold poison requeue --record 42          # the record 42 of the scope \"default\"\n  \
        leasehold poison requeue --all\n\n\
        Exit status: 0 done, 1 error, 3 incomplete (run it again when it says), 130 interrupted."
    )]
    Requeue {
        #[command(flatten)]
        select: Select,
        /// Print JSON (what was done to each entry) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove entries for good (needs --yes).
    ///
    /// Like requeue, it says "incomplete: N hidden, run again after T" (exit status 3) when the
    /// queue holds entries it could not see, and Ctrl-C puts back what it holds (130).
    #[command(
        after_help = "Examples:\n  leasehold poison purge 7c0e9a4e-1f52-4c2b-9d43-3f0d6f0e2a11 --yes\n  \
        leasehold poison purge --all --yes\n\n\
        Exit status: 0 done, 1 error, 3 incomplete (run it again when it says), 130 interrupted."
    )]
    Purge {
        #[command(flatten)]
        select: Select,
        /// Confirm: the entries are gone for good.
        #[arg(long)]
        yes: bool,
        /// Print JSON (what was done to each entry) instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Which poison entries: ids, a scope and/or record, or all.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = true)]
struct Select {
    /// Entry ids (from `poison list`).
    #[arg(conflicts_with_all = ["scope", "record", "all"])]
    ids: Vec<String>,
    /// Every entry of this scope (with --record, of that record only).
    #[arg(long, conflicts_with = "all")]
    scope: Option<Scope>,
    /// Every entry of this record: of --scope, or of the scope "default" without one (as in
    /// `enqueue`, `status` and `break`).
    #[arg(long, conflicts_with = "all")]
    record: Option<RecordId>,
    /// Every entry.
    #[arg(long)]
    all: bool,
}

impl Select {
    fn selection(self) -> ops::PoisonSelection {
        if self.all {
            ops::PoisonSelection::all()
        } else if !self.ids.is_empty() {
            ops::PoisonSelection::ids(self.ids)
        } else {
            ops::PoisonSelection::matching(self.scope, self.record)
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,azure_core=warn,reqwest=warn,hyper=warn")
    });
    use std::io::IsTerminal;
    use tracing_subscriber::fmt::writer::MakeWriterExt;
    // Logs go to stderr, but the handler's metrics event to stdout: the Functions host rates a
    // stderr line by its words ("fail", "error" → Error, "warn" → Warning), and the event's
    // field names hold such words; stdout lines are Information.
    let writer = std::io::stdout
        .with_filter(|meta: &tracing::Metadata<'_>| meta.target() == leasehold::telemetry::EVENT_TARGET)
        .or_else(std::io::stderr);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn main() -> std::process::ExitCode {
    // First, before a secret is read: see `protect_secrets`.
    protect_secrets();
    let cli = Cli::parse();
    // The supervisor of a logic command runs without the async runtime and without logging.
    // So do a container's init and the supervisor of a logic command.
    let cli = match cli.command {
        Some(Command::Supervise { grace_ms, command }) => return supervise(grace_ms, command),
        #[cfg(unix)]
        Some(Command::Init { args }) => return leasehold::init::run(args),
        command => Cli { command, ..cli },
    };
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

/// Makes this process non-dumpable (`PR_SET_DUMPABLE` 0), in every mode and in the supervisor
/// of a logic command: its `/proc/<pid>/environ`, `mem`, `maps` and `fd/` then belong to root,
/// and it cannot be traced, by any process without `CAP_SYS_PTRACE`, the same user's included.
/// A logic command runs as this process's user; without this it read `AzureWebJobsStorage`,
/// `LEASEHOLD_API_KEY` and `LEASEHOLD_ADMIN_KEY` from `/proc/<worker>/environ`. The flag is not
/// inherited across `exec`, so the logic itself is an ordinary process. The cost: no core
/// dumps of Leasehold.
#[cfg(target_os = "linux")]
fn protect_secrets() {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        eprintln!("leasehold: could not make the process non-dumpable (PR_SET_DUMPABLE): {e}");
    }
}

#[cfg(not(target_os = "linux"))]
fn protect_secrets() {}

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
    // Dataverse commands need no storage settings.
    if let Command::Dataverse(command) = command {
        println!("{}", leasehold::dataverse::run(command).await?);
        return Ok(());
    }
    let mut settings = Settings::from_env()?;
    let mode = match command {
        Command::Handler => Mode::Handler,
        Command::Serve {
            port,
            demo,
            insecure_no_start_key,
        } => {
            settings.insecure_no_start_key |= insecure_no_start_key;
            Mode::Standalone { port, demo }
        }
        Command::Enqueue { scope, record_id } => {
            let operator = ops::Operator::new(&settings)?;
            operator.enqueue(&scope, &record_id).await?;
            println!("enqueued {scope}/{record_id} on {}", operator.queue_name());
            return Ok(());
        }
        Command::Status {
            scope,
            record_id,
            limit,
            after,
            json,
        } => {
            println!(
                "{}",
                status(&settings, scope, record_id, limit, after, json).await?
            );
            return Ok(());
        }
        Command::Poison(command) => {
            let (out, status) = poison(&settings, command).await?;
            if !out.is_empty() {
                println!("{out}");
            }
            if status != 0 {
                use std::io::Write;
                std::io::stdout().flush().ok();
                std::process::exit(status);
            }
            return Ok(());
        }
        Command::Break {
            scope,
            record_id,
            reason,
            now,
        } => {
            let operator = ops::Operator::new(&settings)?;
            println!(
                "{}",
                operator.break_lease(&scope, &record_id, &reason, now).await?
            );
            return Ok(());
        }
        Command::Supervise { .. } => bail!("`supervise` runs before the async runtime starts"),
        #[cfg(unix)]
        Command::Init { .. } => bail!("`init` runs before the async runtime starts"),
        Command::Dataverse(_) => unreachable!("handled above"),
    };
    let app = Application::build(settings, mode).await?;
    app.run_until_stopped(shutdown_signal()).await
}

fn to_json(value: &impl serde::Serialize) -> Result<String> {
    Ok(serde_json::to_string_pretty(value)?)
}

async fn status(
    settings: &Settings,
    scope: Option<Scope>,
    record_id: Option<RecordId>,
    limit: usize,
    after: Option<String>,
    json: bool,
) -> Result<String> {
    let operator = ops::Operator::new(settings)?;
    let Some(record_id) = record_id else {
        let overview = operator
            .overview(&ops::OverviewQuery {
                scope,
                limit: Some(limit),
                after,
            })
            .await?;
        return if json {
            to_json(&overview)
        } else {
            Ok(ops::text::overview(&overview))
        };
    };
    let scope = scope.unwrap_or_default();
    let (record, queue, poison) = tokio::join!(
        operator.record(&scope, &record_id),
        operator.queue_view_of(false),
        operator.queue_view_of(true),
    );
    let (record, queue, poison) = (record?, queue?, poison?);
    if json {
        return to_json(&serde_json::json!({ "record": record, "queue": queue, "poison": poison }));
    }
    Ok(ops::text::record(&record, Some((&queue, &poison))))
}

/// Exit status of a requeue or purge that could not reach every entry (run it again).
const EXIT_INCOMPLETE: i32 = 3;
/// Exit status after Ctrl-C (128 + SIGINT).
const EXIT_INTERRUPTED: i32 = 130;

/// The status a requeue or purge exits with.
fn report_status(complete: bool, interrupted: bool) -> i32 {
    if interrupted {
        EXIT_INTERRUPTED
    } else if complete {
        0
    } else {
        EXIT_INCOMPLETE
    }
}

/// What a poison command prints, and the status it exits with.
async fn poison(settings: &Settings, command: PoisonCommand) -> Result<(String, i32)> {
    // Ctrl-C (or SIGTERM) stops a scan, which puts back what it holds; a second one quits at
    // once (what the scan holds then comes back by itself within its hiding).
    let operator = ops::Operator::new(settings)?.with_interrupt(interrupt_signal()?);
    let interrupted = |e: &ops::OpsError| matches!(e, ops::OpsError::Interrupted(_));
    match command {
        PoisonCommand::List { limit, json } => {
            let list = match operator
                .poison_list(&ops::PoisonQuery { limit: Some(limit) })
                .await
            {
                Err(e) if interrupted(&e) => {
                    eprintln!("leasehold: {e}");
                    return Ok((String::new(), EXIT_INTERRUPTED));
                }
                other => other?,
            };
            let out = if json {
                to_json(&list)?
            } else {
                ops::text::poison_list(&list)
            };
            Ok((out, 0))
        }
        PoisonCommand::Show { id, json } => {
            let entry = match operator.poison_show(&id).await {
                Err(e) if interrupted(&e) => {
                    eprintln!("leasehold: {e}");
                    return Ok((String::new(), EXIT_INTERRUPTED));
                }
                other => other?,
            };
            let out = if json {
                to_json(&entry)?
            } else {
                ops::text::poison_entry(&entry)
            };
            Ok((out, 0))
        }
        PoisonCommand::Requeue { select, json } => {
            use std::io::IsTerminal;
            let interactive = std::io::stderr().is_terminal();
            let progress = move |p: &ops::Progress| {
                // Every 100 entries (and on a terminal, as it goes).
                if p.scanned.is_multiple_of(100) || (interactive && p.scanned.is_multiple_of(10)) {
                    eprintln!(
                        "… {} scanned, {} requeued (about {} in the queue)",
                        p.scanned, p.done, p.total
                    );
                }
            };
            let report = operator.poison_requeue(&select.selection(), &progress).await?;
            let status = report_status(report.complete, report.interrupted);
            let out = if json {
                to_json(&report)?
            } else {
                ops::text::requeue(&report)
            };
            Ok((out, status))
        }
        PoisonCommand::Purge { select, yes, json } => {
            if !yes {
                bail!(
                    "purge removes poison entries for good: add --yes to confirm (or look first: leasehold poison list)"
                );
            }
            let report = operator.poison_purge(&select.selection()).await?;
            let status = report_status(report.complete, report.interrupted);
            let out = if json {
                to_json(&report)?
            } else {
                ops::text::purge(&report)
            };
            Ok((out, status))
        }
    }
}

/// Cancelled on the first SIGINT or SIGTERM (the handlers are in place when this returns); the
/// second quits at once with status 130.
fn interrupt_signal() -> Result<CancellationToken> {
    let token = CancellationToken::new();
    let t = token.clone();
    let hide = ops::SCAN_HIDE.as_secs();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        tokio::spawn(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            eprintln!(
                "leasehold: interrupted: putting back what the scan holds (again to quit at once: it then comes back \
                 by itself within {hide} s)"
            );
            t.cancel();
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            eprintln!("leasehold: quit; what the scan held comes back by itself within {hide} s");
            std::process::exit(EXIT_INTERRUPTED);
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("leasehold: interrupted: putting back what the scan holds (again to quit at once)");
            t.cancel();
        }
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("leasehold: quit; what the scan held comes back by itself within {hide} s");
            std::process::exit(EXIT_INTERRUPTED);
        }
    });
    Ok(token)
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
