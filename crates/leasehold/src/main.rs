//! `leasehold`: the executable. The command line, logging and signals only; the application
//! is the `leasehold` library (`src/lib.rs`).

use std::ffi::OsString;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use leasehold::{Application, Mode, Settings};
use tokio_util::sync::CancellationToken;

/// Long per-record work on Azure: one run per record at a time, every event honoured, bursts
/// coalesced into one follow-up run, recovery from crashes in about a minute.
///
/// Settings come from the environment (AzureWebJobsStorage, LEASEHOLD_*); see docs/configuration.md.
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
    #[command(flatten)]
    Ops(leasehold_ops::cli::Command),
    /// Wire a Dataverse (Dynamics 365) environment to Start: register, list, unregister the
    /// webhook and its steps.
    #[command(subcommand)]
    Dataverse(leasehold_dataverse::DataverseCommand),
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
        println!("{}", leasehold_dataverse::run(command).await?);
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
        Command::Ops(command) => {
            // History commands would otherwise say only that history is off.
            if let Some(why) = &settings.history_off {
                eprintln!("leasehold: {why}");
            }
            let status = leasehold_ops::cli::run(command, &settings.storage()).await?;
            if status != 0 {
                use std::io::Write;
                std::io::stdout().flush().ok();
                std::process::exit(status);
            }
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
