//! The record logic Leasehold runs: a shell command (`LEASEHOLD_LOGIC_COMMAND`), an HTTP POST
//! (`LEASEHOLD_LOGIC_URL`), or a demo for local runs. Each is stopped when the run is cancelled
//! (lease lost, time limit, shutdown). Rust users implement `leasehold_runtime::Logic` directly.
//!
//! A command runs under a small supervising process ([`supervise`], the `leasehold supervise`
//! subcommand) that keeps the command's whole process tree in a process group of its own and
//! stops all of it: when the run is cancelled, when the command exits (processes it left behind),
//! and when the worker dies, however it dies (the supervisor's stdin is the worker's end of a
//! pipe, which the kernel closes then).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_runtime::{Logic, LogicError, RunContext};

use crate::Error;
use tokio::io::AsyncReadExt;

/// How long a cancelled command gets between SIGTERM and SIGKILL (the default of
/// [`CommandLogic::with_grace`]).
pub const TERMINATE_GRACE: Duration = Duration::from_secs(5);
/// How long a command gets between SIGTERM and SIGKILL when its worker is gone (the supervisor's
/// control channel closed): the lease may pass to another worker soon.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(1);
/// Beyond the grace, how long the worker waits for a stopped supervisor before it kills it.
#[cfg(unix)]
const SUPERVISOR_SLACK: Duration = Duration::from_secs(2);
/// After the supervisor exits, how long its stderr is still read (a process that left the
/// command's process group may hold it open).
#[cfg(unix)]
const STDERR_DRAIN: Duration = Duration::from_secs(1);
/// Bytes of a failed command's stderr kept for the failure reason.
#[cfg(unix)]
const STDERR_TAIL: usize = 2048;

/// The exit code with which a logic command asks to be run again later (`EX_TEMPFAIL` of
/// `sysexits.h`). The delay is the last `Retry-After: <seconds or HTTP-date>` line the command
/// wrote to stderr; without one, the runner's default. With such a line the command passes on
/// its downstream's "too many" ([`LogicError::throttled`]): its downstream budget pauses too.
pub const RUN_LATER_EXIT_CODE: i32 = 75;

/// The delay a `Retry-After` value asks for: whole seconds, or an HTTP-date (a date in the past
/// is 0), measured from `now` (the answer's `Date` if it has one). `None`: not a value of either
/// form.
pub fn retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // More digits than a u64 holds is still "a very long time".
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Finds `Retry-After:` lines in a command's stderr as it streams: the last one counts. A line
/// is looked at only if it is short (a longer one cannot be such a line), so a command writing
/// megabytes costs nothing but the scan.
#[cfg(unix)]
#[derive(Default)]
struct RetryAfterLines {
    line: Vec<u8>,
    overlong: bool,
    last: Option<String>,
}

#[cfg(unix)]
impl RetryAfterLines {
    const MAX_LINE: usize = 256;

    fn push(&mut self, chunk: &[u8]) {
        for &b in chunk {
            if b == b'\n' {
                self.end_line();
            } else if self.line.len() < Self::MAX_LINE {
                self.line.push(b);
            } else {
                self.overlong = true;
            }
        }
    }

    fn end_line(&mut self) {
        if !self.overlong
            && let Ok(line) = std::str::from_utf8(&self.line)
            && let Some((name, value)) = line.trim().split_once(':')
            && name.trim().eq_ignore_ascii_case("retry-after")
        {
            self.last = Some(value.trim().to_string());
        }
        self.line.clear();
        self.overlong = false;
    }

    /// The last value, the line in progress included.
    fn finish(mut self) -> Option<String> {
        self.end_line();
        self.last
    }
}

/// The setting naming, comma-separated, the worker's environment variables a logic command gets
/// beyond [`COMMAND_BASE_ENV`] (read by [`CommandEnv::from_worker`]).
pub const LOGIC_ENV_SETTING: &str = "LEASEHOLD_LOGIC_ENV";

/// The worker's environment variables every logic command gets (those that are set): what a
/// script needs to find programs, use a home and temporary directory, and read and write text,
/// and nothing that grants access to anything.
pub const COMMAND_BASE_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TMPDIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
];

/// The part of the worker's environment a logic command gets: [`COMMAND_BASE_ENV`] and the names
/// the user allowed, with their values when it was made (start-up). Nothing else of the worker's
/// environment reaches the command (or its supervisor): not the storage connection string, not
/// Start's key, not the platform's identity endpoints and secrets.
#[derive(Clone, Default)]
pub struct CommandEnv {
    vars: Vec<(OsString, OsString)>,
}

impl std::fmt::Debug for CommandEnv {
    /// Names only: the values may be secrets the user chose to pass on.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.vars.iter().map(|(name, _)| name))
            .finish()
    }
}

impl CommandEnv {
    /// From this process's environment, with the names [`LOGIC_ENV_SETTING`]
    /// (`LEASEHOLD_LOGIC_ENV`) lists allowed (see [`from_vars`](Self::from_vars)).
    pub fn from_worker() -> Self {
        let allowed = std::env::var_os(LOGIC_ENV_SETTING).unwrap_or_default();
        Self::from_vars(std::env::vars_os(), allowed.to_string_lossy().split([',', ';']))
    }

    /// From `worker` (a worker's environment): the [`COMMAND_BASE_ENV`] variables and those
    /// named in `allowed` that are set. Logs a warning, naming the variable and never its value,
    /// for an allowed name that looks like a secret (it is passed on: the user asked for it) and
    /// for one that is not set.
    pub fn from_vars<V, K, W, A, N>(worker: V, allowed: A) -> Self
    where
        V: IntoIterator<Item = (K, W)>,
        K: Into<OsString>,
        W: Into<OsString>,
        A: IntoIterator<Item = N>,
        N: AsRef<str>,
    {
        let worker: Vec<(OsString, OsString)> =
            worker.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        let mut names: Vec<String> = COMMAND_BASE_ENV.iter().map(|n| n.to_string()).collect();
        for name in allowed {
            let name = name.as_ref().trim();
            if name.is_empty() || names.iter().any(|n| n == name) {
                continue;
            }
            if !worker.iter().any(|(k, _)| k == name) {
                tracing::warn!(
                    variable = name,
                    "{LOGIC_ENV_SETTING} names {name}, which is not set: the logic command will not get it"
                );
            } else if looks_secret(name) {
                tracing::warn!(
                    variable = name,
                    "{LOGIC_ENV_SETTING} passes {name} on to the logic command; it looks like a secret"
                );
            }
            names.push(name.to_string());
        }
        let vars = worker
            .into_iter()
            .filter(|(k, _)| names.iter().any(|n| k == n.as_str()))
            .collect();
        Self { vars }
    }
}

/// Whether a variable's name suggests a credential (for the warning of [`CommandEnv::from_vars`]).
fn looks_secret(name: &str) -> bool {
    let name = name.to_ascii_uppercase();
    name.starts_with("AZUREWEBJOBS")
        || name.starts_with("APPSETTING_")
        || [
            "KEY",
            "SECRET",
            "PASSWORD",
            "PASSWD",
            "TOKEN",
            "CREDENTIAL",
            "CONNECTIONSTRING",
            "CONNECTION_STRING",
            "IDENTITY_HEADER",
        ]
        .iter()
        .any(|word| name.contains(word))
}

/// The executable that supervises a logic command: `<program> <args…> --grace-ms <N> -- sh -c
/// <command>` must behave as [`supervise`] (the `leasehold` binary's hidden `supervise`
/// subcommand does).
#[derive(Debug, Clone)]
pub struct Supervisor {
    program: PathBuf,
    args: Vec<OsString>,
}

impl Supervisor {
    /// This executable's `supervise` subcommand: for the `leasehold` binary.
    pub fn current_exe() -> std::io::Result<Self> {
        Ok(Self::program(std::env::current_exe()?, ["supervise"]))
    }

    /// Any executable that runs [`supervise`] with these leading arguments (e.g. the `leasehold`
    /// binary and `["supervise"]`).
    pub fn program<I, A>(path: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: Into<OsString>,
    {
        Self {
            program: path.into(),
            args: args.into_iter().map(Into::into).collect(),
        }
    }
}

/// Runs `sh -c <command>` per record with `LEASEHOLD_SCOPE`, `LEASEHOLD_RECORD_ID`,
/// `LEASEHOLD_FENCING_TOKEN` (empty when fencing is off), `LEASEHOLD_ATTEMPT` and, when the
/// trigger is traced, `TRACEPARENT` (and `TRACESTATE`) in its environment. Exit 0 is success.
///
/// The command does not inherit the worker's environment: it gets the run's variables and a
/// [`CommandEnv`] (by default the base variables; the `leasehold` executable adds those
/// `LEASEHOLD_LOGIC_ENV` names), so the worker's secrets stay with the worker.
///
/// The command runs in a process group of its own under a supervising process (see
/// [`Supervisor`] and [`supervise`]), so every process it starts is stopped with it:
/// - on cancellation the whole group gets SIGTERM, then SIGKILL after the grace (5 s by default)
///   if any process of it is left; the run ends as soon as none is. The grace is every
///   process's: a program `sh -c` did not `exec` (dash does not always) has it too, although
///   the shell, the group's leader, dies of the SIGTERM at once;
/// - when the command exits on its own, processes it left running (`sleep 600 &`) are killed at
///   once;
/// - when the run future is dropped or the worker process dies (SIGKILL included), the group
///   gets SIGTERM, then SIGKILL after [`ORPHAN_GRACE`], in the same way.
///
/// A process that moves itself to another process group or session (`setsid`) escapes this.
///
/// A library user embedding `CommandLogic` must provide a supervisor executable: the `leasehold`
/// binary (`Supervisor::program("/path/to/leasehold", ["supervise"])`), or a binary of their own
/// whose `main` calls [`supervise`].
#[cfg(unix)]
#[derive(Debug, Clone)]
pub struct CommandLogic {
    command: String,
    supervisor: Supervisor,
    grace: Duration,
    env: CommandEnv,
    app_root: Option<std::path::PathBuf>,
}

#[cfg(unix)]
impl CommandLogic {
    /// A command that gets its run's variables and the [`COMMAND_BASE_ENV`] ones of this
    /// process (read now); [`with_env`](Self::with_env) passes more, e.g.
    /// [`CommandEnv::from_worker`] for what `LEASEHOLD_LOGIC_ENV` names.
    pub fn new(command: impl Into<String>, supervisor: Supervisor) -> Self {
        Self {
            command: command.into(),
            supervisor,
            grace: TERMINATE_GRACE,
            env: CommandEnv::from_vars(std::env::vars_os(), std::iter::empty::<&str>()),
            app_root: None,
        }
    }

    /// Runs the command in `dir` and tells it where that is in `LEASEHOLD_APP_ROOT`, so a
    /// command packed beside the executable (`scripts/package.sh --logic DIR` puts DIR at
    /// `logic/`) can be named relative to it, whatever directory the host started us in.
    pub fn with_app_root(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.app_root = Some(dir.into());
        self
    }

    /// The worker variables the command gets besides the run's (instead of the base ones).
    pub fn with_env(mut self, env: CommandEnv) -> Self {
        self.env = env;
        self
    }

    /// How long a cancelled command gets between SIGTERM and SIGKILL (default 5 s). Keep it
    /// well inside the runner's `stop_grace`: the worker waits this long plus 2 s.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Stops a cancelled run: SIGTERM to the supervisor (which stops the command's group),
    /// SIGKILL to the supervisor if it has not exited after the grace plus some slack.
    async fn stop(&self, child: &mut tokio::process::Child) {
        // `id()` is `Some` until the child has been reaped, so the pid is still ours.
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
            if tokio::time::timeout(self.grace + SUPERVISOR_SLACK, child.wait())
                .await
                .is_ok()
            {
                return;
            }
            tracing::error!(supervisor = pid, grace = ?self.grace,
                "the logic supervisor did not exit after SIGTERM; killing it (processes of the logic command may survive)");
        }
        let _ = child.kill().await;
    }
}

/// The last [`STDERR_TAIL`] bytes (or a little more) of a stream.
#[cfg(unix)]
#[derive(Default)]
struct Tail(Vec<u8>);

#[cfg(unix)]
impl Tail {
    fn push(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(chunk);
        if self.0.len() > 2 * STDERR_TAIL {
            self.0.drain(..self.0.len() - STDERR_TAIL);
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0[self.0.len().saturating_sub(STDERR_TAIL)..])
            .trim()
            .to_string()
    }
}

#[cfg(unix)]
#[async_trait]
impl Logic for CommandLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let mut command = tokio::process::Command::new(&self.supervisor.program);
        command
            .args(&self.supervisor.args)
            .arg("--grace-ms")
            .arg(self.grace.as_millis().to_string())
            .arg("--")
            .arg("sh")
            .arg("-c")
            .arg(&self.command)
            // The supervisor passes its environment on to the command: both get only this.
            .env_clear()
            .envs(self.env.vars.iter().map(|(k, v)| (k, v)))
            .env("LEASEHOLD_SCOPE", ctx.scope.as_str())
            .env("LEASEHOLD_RECORD_ID", ctx.record_id.as_str())
            .env(
                "LEASEHOLD_FENCING_TOKEN",
                ctx.fencing_token.map(|t| t.to_string()).unwrap_or_default(),
            )
            .env("LEASEHOLD_ATTEMPT", ctx.attempt.to_string())
            .env("LEASEHOLD_DEFERRED_SECONDS", ctx.deferred.as_secs().to_string());
        // The run's trace context, as W3C's environment-variable carrier names it.
        if let Some(trace) = &ctx.trace {
            command.env("TRACEPARENT", trace.traceparent());
            if let Some(state) = &trace.state {
                command.env("TRACESTATE", state);
            }
        }
        if let Some(root) = &self.app_root {
            command.current_dir(root).env("LEASEHOLD_APP_ROOT", root);
        }
        let mut child = command
            // The control channel: open while this run lasts. Its end here closes when the run
            // is dropped or the worker dies, and the supervisor then stops the command.
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            // Out of the worker's process group: a Ctrl-C at a terminal reaches the worker,
            // which stops its runs in order, not the supervisor.
            .process_group(0)
            // SIGKILLing the supervisor would orphan the command; dropping the control channel
            // stops it instead.
            .kill_on_drop(false)
            .spawn()
            .map_err(|error| Error::Spawn {
                program: self.supervisor.program.clone(),
                error,
            })?;
        let _control = child.stdin.take();
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let mut tail = Tail::default();
        let mut retry_after_lines = RetryAfterLines::default();
        let mut buf = [0u8; 4096];
        let mut stderr_open = true;
        let status = loop {
            tokio::select! {
                biased;
                status = child.wait() => break status,
                _ = ctx.cancel.cancelled() => {
                    self.stop(&mut child).await;
                    return Err(Error::CommandTerminated.into());
                }
                n = stderr.read(&mut buf), if stderr_open => match n {
                    Ok(n) if n > 0 => {
                        tail.push(&buf[..n]);
                        retry_after_lines.push(&buf[..n]);
                    }
                    _ => stderr_open = false,
                },
            }
        };
        let status = status.map_err(Error::CommandWait)?;
        if status.success() {
            return Ok(());
        }
        if stderr_open {
            let _ = tokio::time::timeout(STDERR_DRAIN, async {
                while let Ok(n @ 1..) = stderr.read(&mut buf).await {
                    tail.push(&buf[..n]);
                    retry_after_lines.push(&buf[..n]);
                }
            })
            .await;
        }
        if status.code() == Some(RUN_LATER_EXIT_CODE) {
            let asked = retry_after_lines.finish();
            let after = asked
                .as_deref()
                .and_then(|v| retry_after(v, std::time::SystemTime::now()));
            let why = match &asked {
                Some(v) if after.is_some() => format!("the logic command exited with 75, Retry-After: {v}"),
                Some(v) => format!(
                    "the logic command exited with 75, with an unreadable Retry-After ({:?}: neither seconds nor an HTTP-date)",
                    v.chars().take(64).collect::<String>()
                ),
                None => "the logic command exited with 75, without a Retry-After line".to_string(),
            };
            // A Retry-After line passes on the downstream's "too many": the run's budget pauses.
            // Without one, only this record is put off.
            return Err(match asked {
                Some(_) => LogicError::throttled(after, why),
                None => LogicError::run_later(after, why),
            });
        }
        Err(Error::CommandFailed {
            code: status.code(),
            stderr: tail.text(),
        }
        .into())
    }
}

/// What [`supervise`] runs: `program args…` (the worker passes `sh -c <command>`), and the grace
/// between SIGTERM and SIGKILL when it is told to stop.
#[derive(Debug, Clone)]
pub struct SuperviseArgs {
    pub grace: Duration,
    pub program: OsString,
    pub args: Vec<OsString>,
}

/// The supervising process of a logic command (`leasehold supervise --grace-ms N -- sh -c CMD`).
/// Call it from a plain `main`, before any async runtime starts.
///
/// It starts `program args…` in a new process group (stdin null, stdout and stderr inherited)
/// and stops the whole group:
/// - on SIGTERM, SIGINT, SIGHUP or a line `stop` on stdin: SIGTERM to the group, then it waits
///   until no process of the group is left (the program and all it started, whether or not the
///   program is still there), and SIGKILLs the group if any is still there after `grace`;
/// - at end of stdin (the worker closed its end or died): the same with a grace of at most
///   [`ORPHAN_GRACE`];
/// - when the program exits on its own (no stop asked for): SIGKILL to whatever is left in the
///   group.
///
/// On Linux it is a child subreaper (`PR_SET_CHILD_SUBREAPER`): processes of the group orphaned
/// by their parent's exit become its children, and it reaps them.
///
/// It then exits with the program's exit code (128 + the signal number if a signal ended it).
/// It writes nothing on stdout, and on stderr only when something goes wrong: 127 or 126 if the
/// program could not be started, 125 for another failure of its own.
#[cfg(unix)]
pub fn supervise(args: SuperviseArgs) -> std::process::ExitCode {
    use std::io::Write;
    match supervisor::run(args) {
        Ok(code) => std::process::ExitCode::from(code),
        Err((code, message)) => {
            let _ = writeln!(std::io::stderr(), "leasehold supervise: {message}");
            std::process::ExitCode::from(code)
        }
    }
}

#[cfg(unix)]
mod supervisor {
    use std::io::BufRead;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::Stdio;
    use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
    use std::time::{Duration, Instant};

    use nix::errno::Errno;
    use nix::sys::signal::{Signal, killpg};
    use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
    use nix::unistd::Pid;
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    use signal_hook::iterator::Signals;

    use super::{ORPHAN_GRACE, SuperviseArgs};

    /// While a stopped group's leader is gone and the rest of the group has its grace, how often
    /// the supervisor looks whether the group is empty yet.
    const LOOK_EVERY: Duration = Duration::from_millis(20);

    /// The supervised process group.
    ///
    /// Its id is its leader's pid, so it must never be signalled once it could be another
    /// group's. While the leader lives, or is an unreaped zombie, its pid holds the id. Once the
    /// leader has exited only the main thread signals the group: at once, before it reaps the
    /// leader, if the command ended on its own; during a stop, after reaping the leader, only
    /// right after finding the group not empty (its members hold the id then; an empty group is
    /// never signalled again). Were its last member to exit between the look and the SIGKILL,
    /// another group could take the id in that moment only once the pid counter had come round
    /// all of `pid_max`.
    struct Group {
        pgid: Pid,
        state: Mutex<State>,
        changed: Condvar,
    }

    #[derive(Default)]
    struct State {
        /// The leader has exited: the main thread alone deals with the group from then on.
        leader_exited: bool,
        /// When the stopped group gets SIGKILL (`None`: not stopped).
        kill_at: Option<Instant>,
    }

    impl Group {
        fn lock(&self) -> MutexGuard<'_, State> {
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        }

        fn signal(&self, state: &State, signal: Signal) {
            if !state.leader_exited {
                let _ = killpg(self.pgid, signal);
            }
        }

        /// SIGTERM now (on the first request), SIGKILL after `grace` (the earliest deadline
        /// asked for wins). A command that ended on its own has been dealt with already.
        fn stop(&self, grace: Duration) {
            let mut state = self.lock();
            if state.kill_at.is_none() {
                if state.leader_exited {
                    return;
                }
                self.signal(&state, Signal::SIGTERM);
            }
            let at = Instant::now() + grace;
            state.kill_at = Some(state.kill_at.map_or(at, |k| k.min(at)));
            self.changed.notify_all();
        }

        /// Sends SIGKILL when the stop deadline passes while the leader runs (a thread of its
        /// own; once the leader has exited, [`Group::wait_until_empty`] does).
        fn kill_when_due(&self) {
            let mut state = self.lock();
            loop {
                if state.leader_exited {
                    return;
                }
                state = match state.kill_at {
                    None => self.changed.wait(state).unwrap_or_else(PoisonError::into_inner),
                    Some(at) => {
                        let now = Instant::now();
                        if now >= at {
                            self.signal(&state, Signal::SIGKILL);
                            return;
                        }
                        self.changed
                            .wait_timeout(state, at - now)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0
                    }
                };
            }
        }

        /// The leader has exited (and is not reaped yet). Whether the group is being stopped;
        /// if not, the command ended on its own and what it left running is killed now.
        fn leader_exited(&self) -> bool {
            let mut state = self.lock();
            if state.kill_at.is_none() {
                self.signal(&state, Signal::SIGKILL);
            }
            state.leader_exited = true;
            self.changed.notify_all();
            state.kill_at.is_some()
        }

        /// SIGKILL to the group now (its leader not reaped yet), and nothing from then on.
        fn kill_now(&self) {
            let mut state = self.lock();
            self.signal(&state, Signal::SIGKILL);
            state.leader_exited = true;
            self.changed.notify_all();
        }

        /// A stopped group whose leader has been reaped: the rest of the group keeps its grace.
        /// Returns when no process of the group is left (reaping those handed to this process),
        /// or, at the deadline, after SIGKILL to what is.
        fn wait_until_empty(&self) {
            let mut state = self.lock();
            loop {
                reap_orphans();
                // Signal 0: ESRCH once no process has the group id (EPERM: one we may not
                // signal still does).
                if killpg(self.pgid, None) == Err(Errno::ESRCH) {
                    return;
                }
                let Some(at) = state.kill_at else { return };
                let now = Instant::now();
                if now >= at {
                    let _ = killpg(self.pgid, Signal::SIGKILL);
                    return;
                }
                // Woken early by a closer deadline (the worker gone during the stop).
                state = self
                    .changed
                    .wait_timeout(state, (at - now).min(LOOK_EVERY))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
    }

    /// Waits until `leader` has exited, leaving it unreaped, and reaps any other child that exits
    /// meanwhile: processes of the command orphaned by their parent's exit are handed to this
    /// process (a child subreaper), and a zombie left in the group would make it look alive.
    fn wait_for_the_leader(leader: Pid) {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
        let mut only_the_leader = false;
        loop {
            let id = if only_the_leader { Id::Pid(leader) } else { Id::All };
            match waitid(id, flags) {
                Ok(status) if status.pid() == Some(leader) => return,
                Ok(status) => {
                    if let Some(orphan) = status.pid() {
                        let _ = waitpid(orphan, Some(WaitPidFlag::WNOHANG));
                    }
                }
                Err(Errno::EINTR) => {}
                // A status nix cannot read (a real-time signal ended the process): no pid to
                // reap by. Orphans wait for the leader's exit from then on.
                Err(_) if !only_the_leader => only_the_leader = true,
                Err(e) => {
                    use std::io::Write;
                    let _ = writeln!(std::io::stderr(), "leasehold supervise: waitid: {e}");
                    return;
                }
            }
        }
    }

    /// Reaps every child that has exited (only once the leader is reaped: any child then is an
    /// orphan of the command).
    fn reap_orphans() {
        loop {
            match waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG) {
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                // EINVAL: reaped, with a status nix cannot read.
                Ok(_) | Err(Errno::EINTR | Errno::EINVAL) => {}
                Err(_) => return,
            }
        }
    }

    pub(super) fn run(args: SuperviseArgs) -> Result<u8, (u8, String)> {
        // Before the program starts, so no stop request is lost.
        let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])
            .map_err(|e| (125, format!("installing signal handlers: {e}")))?;
        // Processes of the command whose parent exits become this process's children, not
        // init's: they are reaped here, so the group is seen empty as soon as they have exited.
        // Without it (not Linux, or refused) init reaps them, a little later.
        #[cfg(target_os = "linux")]
        let _ = nix::sys::prctl::set_child_subreaper(true);
        let mut child = std::process::Command::new(&args.program)
            .args(&args.args)
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| {
                let code = if e.kind() == std::io::ErrorKind::NotFound {
                    127
                } else {
                    126
                };
                (
                    code,
                    format!("could not start {}: {e}", args.program.to_string_lossy()),
                )
            })?;
        let pid = i32::try_from(child.id()).map_err(|e| (125, e.to_string()))?;
        // The child is the leader of its new group (set before `spawn` returned).
        let group = Arc::new(Group {
            pgid: Pid::from_raw(pid),
            state: Mutex::default(),
            changed: Condvar::new(),
        });
        let grace = args.grace;
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map(drop)
                .map_err(|e| format!("starting a thread: {e}"))
        };
        let mut failures = Vec::new();
        let g = group.clone();
        failures.extend(
            spawn(
                "signals",
                Box::new(move || {
                    for _ in signals.forever() {
                        g.stop(grace);
                    }
                }),
            )
            .err(),
        );
        let g = group.clone();
        failures.extend(
            spawn(
                "control",
                Box::new(move || {
                    for line in std::io::stdin().lock().split(b'\n') {
                        match line {
                            Ok(line) if line.trim_ascii() == b"stop" => g.stop(grace),
                            Ok(_) => {}
                            Err(_) => break,
                        }
                    }
                    g.stop(grace.min(ORPHAN_GRACE));
                }),
            )
            .err(),
        );
        let g = group.clone();
        failures.extend(spawn("killer", Box::new(move || g.kill_when_due())).err());
        if let Some(e) = failures.first() {
            // Without its threads it could not be stopped: kill the program's group now (its
            // leader is not reaped yet).
            group.kill_now();
            let _ = child.wait();
            return Err((125, e.clone()));
        }

        // The leader's pid, and so the group id, stay taken until it is reaped.
        wait_for_the_leader(group.pgid);
        let stopping = group.leader_exited();
        let status = child.wait().map_err(|e| {
            (
                125,
                format!("waiting for {}: {e}", args.program.to_string_lossy()),
            )
        })?;
        if stopping {
            // The grace is the whole group's: the leader may be a shell that ran the command as
            // its child (`sh -c` does not always `exec`) and died of the SIGTERM at once.
            group.wait_until_empty();
        }
        Ok(match (status.code(), status.signal()) {
            (Some(code), _) => (code & 0xff) as u8,
            (None, Some(signal)) => 128u8.saturating_add(u8::try_from(signal).unwrap_or(127)),
            (None, None) => 125,
        })
    }
}

/// POSTs `{"scope", "recordId", "fencingToken", "attempt"}` to a URL per record (the fencing
/// token also as the `x-leasehold-fencing-token` header, the run's trace context as
/// `traceparent`/`tracestate`). Any 2xx is success. On cancellation the
/// request is abandoned (the connection is closed).
///
/// Redirects are not followed: a 3xx is a failed run naming the status and the `Location`. A
/// followed 301/302/303 would turn the POST into a body-less GET, whose 2xx would count as a
/// completed run although the logic never saw the record.
#[derive(Debug, Clone)]
pub struct UrlLogic {
    url: reqwest::Url,
    client: reqwest::Client,
    timeout: Duration,
}

impl UrlLogic {
    pub fn new(url: &str, timeout: Duration) -> Result<Self, Error> {
        let url = reqwest::Url::parse(url)?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Error::UnsupportedScheme(url.scheme().to_string()));
        }
        // A client of its own, not storage's shared one: storage follows redirects (the
        // default policy), the logic must not. Idle connections are closed as storage's are,
        // before a server's usual 5 s keep-alive ends them; the time limit is per request.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .pool_idle_timeout(leasehold_storage::azure::POOL_IDLE_TIMEOUT)
            .build()
            .map_err(|e| Error::HttpClient(e.without_url()))?;
        Ok(Self { url, client, timeout })
    }
}

#[async_trait]
impl Logic for UrlLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let body = serde_json::json!({
            "scope": ctx.scope,
            "recordId": ctx.record_id,
            "fencingToken": ctx.fencing_token,
            "attempt": ctx.attempt,
            "deferredSeconds": ctx.deferred.as_secs(),
        });
        let mut request = self
            .client
            .post(self.url.clone())
            .timeout(self.timeout)
            .json(&body);
        if let Some(token) = ctx.fencing_token {
            request = request.header("x-leasehold-fencing-token", token.to_string());
        }
        // The run's span is the request's parent: the downstream's spans join the trace.
        if let Some(trace) = &ctx.trace {
            request = request.header("traceparent", trace.traceparent());
            if let Some(state) = &trace.state {
                request = request.header("tracestate", state);
            }
        }
        let response = tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => return Err(Error::RequestAbandoned.into()),
            r = request.send() => r,
        };
        // Only the host and path are named: a query string may hold a key.
        let target = format!("{}{}", self.url.host_str().unwrap_or(""), self.url.path());
        let response = response.map_err(|e| Error::Request {
            target: target.clone(),
            error: e.without_url(),
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        if status.is_redirection() {
            let location = response
                .headers()
                .get(reqwest::header::LOCATION)
                .map(|l| match l.to_str().ok().and_then(|l| self.url.join(l).ok()) {
                    Some(to) => shown(&to),
                    None => "an unreadable Location".to_string(),
                })
                .unwrap_or_else(|| "no Location".to_string());
            return Err(Error::Redirected {
                target,
                status,
                location,
            }
            .into());
        }
        // 429, and 503 that says when to come back: the service asks for patience, and the
        // record runs again later instead of failing. A 503 that does not say when is an outage,
        // and fails (so it surfaces after the retries instead of hiding behind deferrals).
        let asked = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS
            || (status == reqwest::StatusCode::SERVICE_UNAVAILABLE && asked.is_some())
        {
            let now = response
                .headers()
                .get(reqwest::header::DATE)
                .and_then(|d| d.to_str().ok())
                .and_then(|d| httpdate::parse_http_date(d).ok())
                .unwrap_or_else(std::time::SystemTime::now);
            let after = asked.as_deref().and_then(|v| retry_after(v, now));
            let why = match &asked {
                Some(v) if after.is_some() => {
                    format!("logic URL {target} answered {status}, Retry-After: {v}")
                }
                Some(v) => format!(
                    "logic URL {target} answered {status} with an unreadable Retry-After ({:?})",
                    v.chars().take(64).collect::<String>()
                ),
                None => format!("logic URL {target} answered {status} without Retry-After"),
            };
            // The downstream said "too many": the run's budget pauses (for the asked time, or
            // its default), and this worker starts fewer of its runs at once.
            return Err(LogicError::throttled(after, why));
        }
        let text = response.text().await.unwrap_or_default();
        Err(Error::Refused {
            target,
            status,
            body: text.chars().take(500).collect(),
        }
        .into())
    }
}

/// A URL as errors show it: scheme, host, port and path; not its user info, query or fragment,
/// which may hold a key.
fn shown(url: &reqwest::Url) -> String {
    let port = url.port().map(|p| format!(":{p}")).unwrap_or_default();
    format!(
        "{}://{}{port}{}",
        url.scheme(),
        url.host_str().unwrap_or(""),
        url.path()
    )
}

/// For local runs: logs the record and waits a few seconds (honouring cancellation).
#[derive(Debug, Clone)]
pub struct DemoLogic {
    pub duration: Duration,
}

#[async_trait]
impl Logic for DemoLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        // Record and fencing token are the fields of the delivery's span.
        tracing::info!("demo logic: working on the record for {:?}", self.duration);
        tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => Err(Error::DemoCancelled.into()),
            _ = tokio::time::sleep(self.duration) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Wed, 25 Nov 2026 10:00:00 GMT").unwrap();
        assert_eq!(retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(retry_after(" 120 ", now), Some(Duration::from_secs(120)));
        assert_eq!(retry_after("0", now), Some(Duration::ZERO));
        assert_eq!(
            retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        assert_eq!(
            retry_after("Wed, 25 Nov 2026 10:01:30 GMT", now),
            Some(Duration::from_secs(90))
        );
        // A date in the past: now.
        assert_eq!(
            retry_after("Wed, 25 Nov 2026 09:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        for bad in ["", "-5", "1.5", "soon", "3 s", "Wed, 25 Nov 2026"] {
            assert_eq!(retry_after(bad, now), None, "{bad:?}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn the_last_retry_after_line_of_stderr_counts_however_it_is_split() {
        let text = b"working\nRETRY-AFTER: 10\nmore noise\n  retry-after:30  \nbye";
        for split in 1..text.len() {
            let mut lines = RetryAfterLines::default();
            for chunk in text.chunks(split) {
                lines.push(chunk);
            }
            assert_eq!(lines.finish().as_deref(), Some("30"), "chunks of {split}");
        }
        // The last line counts without its newline; an overlong line is not read.
        let mut lines = RetryAfterLines::default();
        lines.push(b"Retry-After: 5\nRetry-After: 7");
        assert_eq!(lines.finish().as_deref(), Some("7"));
        let mut lines = RetryAfterLines::default();
        lines.push(format!("Retry-After: 5\nRetry-After: 9{}\n", " ".repeat(300)).as_bytes());
        assert_eq!(lines.finish().as_deref(), Some("5"));
        assert_eq!(RetryAfterLines::default().finish(), None);
    }

    #[test]
    fn a_command_env_holds_the_base_and_the_allowed_names_and_shows_no_value() {
        let worker = [
            ("PATH", "/usr/bin"),
            ("AzureWebJobsStorage", "AccountKey=SECRET"),
            ("LEASEHOLD_API_KEY", "SECRET"),
            ("CRM_URL", "https://crm"),
            ("CRM_CLIENT_SECRET", "allowed-SECRET"),
        ];
        let env = CommandEnv::from_vars(worker, [" CRM_URL", "CRM_CLIENT_SECRET ", "", "PATH"]);
        let names: Vec<_> = env.vars.iter().map(|(k, _)| k.to_str().unwrap()).collect();
        assert_eq!(names, ["PATH", "CRM_URL", "CRM_CLIENT_SECRET"]);
        let shown = format!("{env:?}");
        assert!(
            shown.contains("CRM_CLIENT_SECRET") && !shown.contains("allowed-SECRET"),
            "{shown}"
        );

        assert!(looks_secret("CRM_CLIENT_SECRET") && looks_secret("AzureWebJobsStorage__accountName"));
        assert!(!looks_secret("CRM_URL") && !looks_secret("REPORT_DIR"));
    }
}
