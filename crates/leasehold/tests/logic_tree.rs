//! `LEASEHOLD_LOGIC_COMMAND` under its supervisor (the real `leasehold supervise`): nothing of
//! the command's process tree outlives its run, whether the run is cancelled, abandoned, ends
//! with a process left in the background, or the worker process itself dies (SIGKILL included).
//!
//! Every process a test starts is found again by the marker in its environment (a record id
//! unique to the test, inherited by the whole tree) and killed when the test ends, also when it
//! fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use leasehold_functions::logic::{CommandLogic, Supervisor};
use leasehold_runtime::{Logic, RunContext};
use leasehold_test_support::{Azurite, eventually, unique_name};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio_util::sync::CancellationToken;

fn supervisor() -> Supervisor {
    Supervisor::program(env!("CARGO_BIN_EXE_leasehold"), ["supervise"])
}

/// Whether `pid` is a live (not zombie) process whose environment holds `marker`.
/// How long a test waits for a process tree it expects gone when how fast is not its point: a
/// signalled process is gone within milliseconds, but a loaded machine may take longer to get
/// there; a tree nobody stops (`sleep 600`) still fails the test.
const GONE_WITHIN: Duration = Duration::from_secs(30);

fn alive_with(pid: u32, marker: &[u8]) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which ends with the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    if matches!(state, None | Some('Z' | 'X' | 'x')) {
        return false;
    }
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == marker))
}

/// One test's logic: a unique record id, a directory for the pid files its command writes, and
/// the processes carrying that record id (the supervisor and the command's whole tree), which
/// are SIGKILLed when this is dropped.
struct Tree {
    record: String,
    marker: Vec<u8>,
    dir: PathBuf,
}

impl Tree {
    fn new() -> Self {
        let record = unique_name("tree");
        let dir = std::env::temp_dir().join(&record);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            marker: format!("LEASEHOLD_RECORD_ID={record}").into_bytes(),
            record,
            dir,
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Shell that starts a `sleep 600` child and records its pid in `child` and the shell's
    /// own in `sh`.
    fn spawn_child(&self) -> String {
        format!(
            "sleep 600 & echo $! > {}; echo $$ > {}",
            self.file("child").display(),
            self.file("sh").display()
        )
    }

    /// Shell that records its pid in `sh` and then starts (to be followed by more shell: not
    /// `exec`ed) a child shell that records its pid in `child` and on SIGTERM cleans up for
    /// `cleanup` seconds (a `sleep` started after the signal) before it writes `cleaned` and
    /// exits 0. The outer shell, the process group's leader, has no trap of its own here.
    ///
    /// The child's stderr goes to a file: its `sleep` killed by the SIGTERM makes it write
    /// "Terminated" there, and the stderr of an abandoned run is a pipe nobody reads any more
    /// (SIGPIPE would end the clean-up).
    fn slow_to_clean_up(&self, cleanup: &str) -> String {
        format!(
            "echo $$ > {sh}; sh -c 'trap \"sleep {cleanup}; echo cleaned > {cleaned}; exit 0\" TERM; \
             echo $$ > {child}; while :; do sleep 0.1; done' 2> {err}",
            sh = self.file("sh").display(),
            child = self.file("child").display(),
            cleaned = self.file("cleaned").display(),
            err = self.file("child.err").display(),
        )
    }

    /// Whether the child of [`Tree::slow_to_clean_up`] finished its clean-up.
    fn cleaned(&self) -> bool {
        std::fs::read_to_string(self.file("cleaned")).is_ok_and(|s| s.trim() == "cleaned")
    }

    /// Live processes carrying this test's record id.
    fn live(&self) -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| alive_with(*pid, &self.marker))
            .collect()
    }

    fn alive(&self, pid: u32) -> bool {
        alive_with(pid, &self.marker)
    }

    /// The pids of the shell and its child, once both are written.
    async fn pids(&self) -> (u32, u32) {
        let read = |name: &str| -> Option<u32> {
            std::fs::read_to_string(self.file(name)).ok()?.trim().parse().ok()
        };
        eventually(
            Duration::from_secs(20),
            "the command to record its pids",
            || async { Some((read("sh")?, read("child")?)) },
        )
        .await
    }

    /// [`Tree::pids`] of a running command (checked).
    async fn running(&self) -> (u32, u32) {
        let (sh, child) = self.pids().await;
        assert!(self.alive(sh) && self.alive(child), "{sh} and {child} run");
        (sh, child)
    }

    /// Waits up to `limit` until none of `pids` and no other process of this tree is alive.
    async fn gone(&self, pids: &[u32], limit: Duration, what: &str) {
        eventually(limit, what, || async {
            (pids.iter().all(|p| !self.alive(*p)) && self.live().is_empty()).then_some(())
        })
        .await;
    }

    fn ctx(&self) -> RunContext {
        RunContext {
            scope: "account".parse().unwrap(),
            record_id: self.record.parse().unwrap(),
            fencing_token: Some(7),
            cancel: CancellationToken::new(),
            attempt: 1,
            deferred: std::time::Duration::ZERO,
            trace: None,
        }
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        for pid in self.live() {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn command_gets_the_record_in_its_environment_and_its_exit_code_counts() {
    let tree = Tree::new();
    let out = tree.file("env.txt");
    let logic = CommandLogic::new(
        format!(
            "echo \"$LEASEHOLD_SCOPE $LEASEHOLD_RECORD_ID $LEASEHOLD_FENCING_TOKEN $LEASEHOLD_ATTEMPT\" > {}",
            out.display()
        ),
        supervisor(),
    );
    logic.run(tree.ctx()).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap().trim(),
        format!("account {} 7 1", tree.record)
    );

    let failing = CommandLogic::new("echo 'the CRM refused the update' >&2; exit 3", supervisor());
    let err = failing.run(tree.ctx()).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "the logic command exited with code 3: the CRM refused the update"
    );
    // A long stderr keeps its end.
    let chatty = CommandLogic::new(
        "i=0; while [ $i -lt 500 ]; do echo \"line $i of the log\" >&2; i=$((i+1)); done; exit 1",
        supervisor(),
    );
    let err = chatty.run(tree.ctx()).await.unwrap_err().to_string();
    assert!(err.ends_with("line 499 of the log"), "{err}");
    assert!(err.len() < 2200, "only the tail is kept: {} bytes", err.len());
}

/// Exit 75 (`EX_TEMPFAIL`) asks to be run later, after the last `Retry-After:` line of stderr;
/// any other exit is a failure.
#[tokio::test]
async fn a_command_exiting_75_asks_to_be_run_later() {
    let tree = Tree::new();
    // The last case column: whether it passes a downstream's "too many" on (a Retry-After line).
    let cases = [
        (
            "echo 'Retry-After: 9' >&2; echo 'throttled, Retry-After: 30' >&2; echo 'Retry-After: 12' >&2; exit 75",
            Some(Some(Duration::from_secs(12))),
            true,
        ),
        ("echo throttled >&2; exit 75", Some(None), false),
        ("echo 'Retry-After: soon' >&2; exit 75", Some(None), true),
        ("echo 'Retry-After: 12' >&2; exit 74", None, false),
    ];
    for (command, wants, throttled) in cases {
        let logic = CommandLogic::new(command, supervisor());
        let err = logic.run(tree.ctx()).await.unwrap_err();
        assert_eq!(err.asks_to_run_later(), wants, "{command}: {err}");
        assert_eq!(err.is_throttled(), throttled, "{command}: {err}");
    }
    let logic = CommandLogic::new("echo 'Retry-After: soon' >&2; exit 75", supervisor());
    let err = logic.run(tree.ctx()).await.unwrap_err().to_string();
    assert!(err.contains("unreadable Retry-After"), "{err}");
    // The command is told how long its trigger has been put off.
    let out = tree.file("deferred.txt");
    let logic = CommandLogic::new(
        format!("echo \"$LEASEHOLD_DEFERRED_SECONDS\" > {}", out.display()),
        supervisor(),
    );
    let mut ctx = tree.ctx();
    ctx.deferred = Duration::from_secs(95);
    logic.run(ctx).await.unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), "95");
}

#[tokio::test]
async fn a_missing_supervisor_is_a_clear_failure() {
    let tree = Tree::new();
    let logic = CommandLogic::new(
        "true",
        Supervisor::program("/nonexistent/leasehold", ["supervise"]),
    );
    let err = logic.run(tree.ctx()).await.unwrap_err().to_string();
    assert!(
        err.contains("could not start the logic supervisor /nonexistent/leasehold"),
        "{err}"
    );
}

#[tokio::test]
async fn cancelling_a_run_stops_the_command_and_its_children() {
    let tree = Tree::new();
    let logic = CommandLogic::new(format!("{}; wait", tree.spawn_child()), supervisor());
    let run = tree.ctx();
    let cancel = run.cancel.clone();
    let task = tokio::spawn(async move { logic.run(run).await });
    let (sh, child) = tree.running().await;
    cancel.cancel();
    let err = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the run ends after cancellation")
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "the logic command was terminated (run cancelled)"
    );
    tree.gone(&[sh, child], GONE_WITHIN, "the shell and its child to be gone")
        .await;
}

#[tokio::test]
async fn a_child_left_in_the_background_does_not_outlive_the_run() {
    let tree = Tree::new();
    let logic = CommandLogic::new(format!("{}; exit 0", tree.spawn_child()), supervisor());
    tokio::time::timeout(Duration::from_secs(20), logic.run(tree.ctx()))
        .await
        .expect("the run ends when the shell exits")
        .unwrap();
    let (sh, child) = tree.pids().await;
    tree.gone(&[sh, child], GONE_WITHIN, "the background child to be gone")
        .await;
}

#[tokio::test]
async fn an_abandoned_run_stops_its_tree_within_about_a_second() {
    let tree = Tree::new();
    // Ignores SIGTERM (and so does its child): only the SIGKILL after the short grace stops it.
    let logic = CommandLogic::new(
        format!("trap '' TERM; {}; wait", tree.spawn_child()),
        supervisor(),
    );
    let run = tree.ctx();
    let task = tokio::spawn(async move { logic.run(run).await });
    let (sh, child) = tree.running().await;
    // As the runner does with logic that will not stop: the run future is dropped.
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let dropped = Instant::now();
    // 1 s grace (ORPHAN_GRACE) + slack: well under the 5 s of a cancelled run.
    tree.gone(
        &[sh, child],
        Duration::from_secs(3),
        "the abandoned tree to be gone",
    )
    .await;
    println!(
        "[logic] abandoned tree gone {:.0?} after the drop",
        dropped.elapsed()
    );
}

#[tokio::test]
async fn a_command_ignoring_sigterm_is_killed_after_the_grace() {
    let tree = Tree::new();
    let grace = Duration::from_secs(1);
    let logic = CommandLogic::new(
        format!("trap '' TERM; {}; wait", tree.spawn_child()),
        supervisor(),
    )
    .with_grace(grace);
    let run = tree.ctx();
    let cancel = run.cancel.clone();
    let task = tokio::spawn(async move { logic.run(run).await });
    let (sh, child) = tree.running().await;
    let cancelled = Instant::now();
    cancel.cancel();
    let err = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the run ends after cancellation")
        .unwrap()
        .unwrap_err();
    let took = cancelled.elapsed();
    assert!(err.to_string().contains("terminated"), "{err}");
    assert!(
        took >= grace,
        "SIGTERM was ignored, so the run lasts the grace: {took:?}"
    );
    assert!(
        took < grace + Duration::from_secs(2),
        "SIGKILL followed the grace, not the worker's fallback: {took:?}"
    );
    tree.gone(&[sh, child], GONE_WITHIN, "the tree to be gone").await;
}

/// The grace is the whole group's, not its leader's: `sh -c` (dash) does not `exec` a command
/// followed by more shell, so the shell leads the group and dies of the SIGTERM at once, while
/// the process doing the work is its child. That child still gets to clean up (1 s here), and
/// the run ends when it has, not at the end of the grace.
#[tokio::test]
async fn a_cancelled_command_that_is_not_the_group_leader_gets_its_grace() {
    let tree = Tree::new();
    let grace = Duration::from_secs(10);
    let logic = CommandLogic::new(
        format!("{}; echo the command goes on", tree.slow_to_clean_up("1")),
        supervisor(),
    )
    .with_grace(grace);
    let run = tree.ctx();
    let cancel = run.cancel.clone();
    let task = tokio::spawn(async move { logic.run(run).await });
    let (sh, child) = tree.running().await;
    let cancelled = Instant::now();
    cancel.cancel();
    let err = tokio::time::timeout(grace + Duration::from_secs(5), task)
        .await
        .expect("the run ends after cancellation")
        .unwrap()
        .unwrap_err();
    let took = cancelled.elapsed();
    assert!(err.to_string().contains("terminated"), "{err}");
    assert!(
        tree.cleaned(),
        "the leader's child finished its clean-up before the run ended ({took:?})"
    );
    assert!(
        took < grace,
        "the run ended when the group had, not after the whole grace: {took:?}"
    );
    assert!(
        !tree.alive(sh) && !tree.alive(child) && tree.live().is_empty(),
        "nothing of the group outlives the run: {:?}",
        tree.live()
    );
}

/// A run dropped (or a worker that died) gives the whole group the orphan grace, too.
#[tokio::test]
async fn an_abandoned_command_that_is_not_the_group_leader_gets_the_orphan_grace() {
    let tree = Tree::new();
    let logic = CommandLogic::new(
        format!("{}; echo the command goes on", tree.slow_to_clean_up("0.3")),
        supervisor(),
    );
    let run = tree.ctx();
    let task = tokio::spawn(async move { logic.run(run).await });
    let (sh, child) = tree.running().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    // 1 s grace (ORPHAN_GRACE) + slack.
    tree.gone(
        &[sh, child],
        Duration::from_secs(3),
        "the abandoned tree to be gone",
    )
    .await;
    assert!(
        tree.cleaned(),
        "the leader's child finished its clean-up within the orphan grace"
    );
}

/// Told to stop, the supervisor waits for the whole group and then exits with its leader's
/// status (here the leader's own `exit 7` on SIGTERM), not with that of a straggler it reaped
/// (the child, which exits 0 after cleaning up).
#[tokio::test]
async fn a_stopped_supervisor_waits_for_the_group_and_exits_as_its_leader() {
    use tokio::io::AsyncWriteExt;
    let tree = Tree::new();
    let command = format!("trap 'exit 7' TERM; {} & wait", tree.slow_to_clean_up("0.5"));
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["supervise", "--grace-ms", "60000", "--", "sh", "-c", &command])
        .env("LEASEHOLD_RECORD_ID", &tree.record)
        .stdin(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut control = child.stdin.take().unwrap();
    let (sh, kid) = tree.running().await;
    control.write_all(b"stop\n").await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the supervisor exits once the group has, well before the 60 s grace")
        .unwrap();
    assert_eq!(status.code(), Some(7));
    assert!(tree.cleaned(), "the leader's child cleaned up");
    assert!(
        !tree.alive(sh) && !tree.alive(kid) && tree.live().is_empty(),
        "nothing of the group outlives the supervisor: {:?}",
        tree.live()
    );
}

/// Orphans of the command (a process whose parent exited) are the supervisor's to reap: their
/// exit is not taken for the command's.
#[tokio::test]
async fn an_orphans_exit_is_not_taken_for_the_commands() {
    let tree = Tree::new();
    let logic = CommandLogic::new(
        "(sh -c 'exit 9' &); sleep 0.5; echo 'the command failed' >&2; exit 4",
        supervisor(),
    );
    let err = logic.run(tree.ctx()).await.unwrap_err().to_string();
    assert_eq!(err, "the logic command exited with code 4: the command failed");
}

#[tokio::test]
async fn the_supervisor_stops_on_a_stop_line_and_passes_exit_codes_on() {
    use tokio::io::AsyncWriteExt;
    let tree = Tree::new();
    let supervise = |grace_ms: &str, command: &str| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_leasehold"));
        cmd.args(["supervise", "--grace-ms", grace_ms, "--", "sh", "-c", command])
            .env("LEASEHOLD_RECORD_ID", &tree.record)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd.spawn().unwrap()
    };
    // Exit code passed on; nothing of its own on stdout or stderr.
    let mut child = supervise("5000", "echo out; echo err >&2; exit 4");
    let control = child.stdin.take();
    let out = child.wait_with_output().await.unwrap();
    drop(control);
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(
        (out.stdout.as_slice(), out.stderr.as_slice()),
        (&b"out\n"[..], &b"err\n"[..])
    );

    // A `stop` line: SIGTERM to the group; a shell killed by it makes 128 + 15.
    let mut child = supervise("60000", &format!("{}; wait", tree.spawn_child()));
    let mut control = child.stdin.take().unwrap();
    let (sh, kid) = tree.running().await;
    control.write_all(b"stop\n").await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the supervisor exits after `stop`")
        .unwrap();
    assert_eq!(status.code(), Some(143));
    tree.gone(&[sh, kid], GONE_WITHIN, "the tree to be gone").await;
}

// ---- End to end: the worker process (`leasehold serve`) dies or shuts down mid-run. ----

/// `leasehold serve` against the shared Azurite, its own queue and container, running `logic`.
struct Serve {
    child: tokio::process::Child,
    port: u16,
    log: PathBuf,
}

impl Serve {
    async fn start(dir: &Path, logic: &str, extra: &[(&str, &str)]) -> Self {
        let log = dir.join("serve.log");
        let mut cmd = common::leasehold(&["serve"]);
        // Any free port, read from the log: none found free and released to race for.
        cmd.envs(common::serve_vars(
            &unique_name("triggers"),
            &unique_name("locks"),
        ))
        .env("LEASEHOLD_LOGIC_COMMAND", logic)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let port = common::serve_port(&log).await;
        let serve = Self { child, port, log };
        common::answers(
            &format!("http://127.0.0.1:{port}/healthz"),
            "leasehold serve to answer",
        )
        .await;
        serve
    }

    async fn trigger(&self, record: &str) {
        let r = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/api/start", self.port))
            .json(&serde_json::json!({"scope": "account", "recordId": record}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 202);
    }

    fn signal(&self, signal: Signal) {
        let pid = i32::try_from(self.child.id().unwrap()).unwrap();
        kill(Pid::from_raw(pid), signal).unwrap();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_worker_leaves_no_process_of_its_logic_running() {
    let tree = Tree::new();
    let mut serve = Serve::start(&tree.dir, &format!("{}; wait", tree.spawn_child()), &[]).await;
    serve.trigger(&tree.record).await;
    let (sh, child) = tree.running().await;
    serve.signal(Signal::SIGKILL);
    let status = serve.child.wait().await.unwrap();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
    tree.gone(
        &[sh, child],
        GONE_WITHIN,
        "the logic of the killed worker to be gone",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_shutting_down_leaves_no_process_of_its_logic_running() {
    let tree = Tree::new();
    let mut serve = Serve::start(
        &tree.dir,
        // Ignores SIGTERM: stopped by the SIGKILL after the 5 s grace.
        &format!("trap '' TERM; {}; wait", tree.spawn_child()),
        &[("LEASEHOLD_SHUTDOWN_GRACE_SECONDS", "1")],
    )
    .await;
    serve.trigger(&tree.record).await;
    let (sh, child) = tree.running().await;
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    // Shutdown grace 1 s + SIGTERM-to-SIGKILL grace 5 s + slack.
    let status = tokio::time::timeout(Duration::from_secs(15), serve.child.wait())
        .await
        .expect("serve exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "clean exit: {status:?}\n{}", serve.log());
    tree.gone(
        &[sh, child],
        Duration::from_secs(9)
            .saturating_sub(signalled.elapsed())
            .max(Duration::from_millis(200)),
        "the logic of the stopped worker to be gone",
    )
    .await;
    assert!(
        !serve.log().contains("did not exit after SIGTERM"),
        "no double fault: {}",
        serve.log()
    );
}

/// The logic command gets the run's variables, a small base (PATH…) and the worker variables
/// `LEASEHOLD_LOGIC_ENV` names, nothing else of the worker's environment: not the storage
/// connection string, not Start's key, not any other secret. A listed secret is passed on, with
/// a warning at start-up naming it (never its value).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_gets_the_run_variables_and_the_allow_list_not_the_workers_secrets() {
    let tree = Tree::new();
    let out = tree.file("env.txt");
    let api_key = "start-key-SECRET-1";
    // Written in full before it appears: `eventually` never reads half of it.
    let logic = format!("env > {0}.tmp && mv {0}.tmp {0}", out.display());
    let serve = Serve::start(
        &tree.dir,
        &logic,
        &[
            ("LEASEHOLD_API_KEY", api_key),
            ("WORKER_SECRET", "worker-SECRET-2"),
            ("APPSETTING_AzureWebJobsStorage", "mirrored-SECRET-3"),
            ("REPORT_DIR", "/srv/reports"),
            ("PARTNER_API_TOKEN", "partner-token-4"),
            (
                "LEASEHOLD_LOGIC_ENV",
                "REPORT_DIR, PARTNER_API_TOKEN,NOT_SET_ANYWHERE",
            ),
        ],
    )
    .await;
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/api/start", serve.port))
        .header("x-functions-key", api_key)
        .json(&serde_json::json!({"scope": "account", "recordId": tree.record}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let env = eventually(
        Duration::from_secs(30),
        "the command to write its environment",
        || async { std::fs::read_to_string(&out).ok() },
    )
    .await;
    let vars: std::collections::BTreeMap<&str, &str> =
        env.lines().filter_map(|l| l.split_once('=')).collect();

    let connection_string = Azurite::shared().connection_string();
    let account_key = connection_string
        .split(';')
        .find_map(|p| p.strip_prefix("AccountKey="))
        .unwrap();
    for secret in [api_key, "worker-SECRET-2", "mirrored-SECRET-3", account_key] {
        assert!(
            !env.contains(secret),
            "a worker secret reached the command:\n{env}"
        );
    }
    for name in [
        "AzureWebJobsStorage",
        "LEASEHOLD_API_KEY",
        "LEASEHOLD_LOGIC_COMMAND",
        "LEASEHOLD_QUEUE",
        "RUST_LOG",
    ] {
        assert!(!vars.contains_key(name), "{name} reached the command:\n{env}");
    }
    assert_eq!(vars.get("LEASEHOLD_SCOPE"), Some(&"account"));
    assert_eq!(vars.get("LEASEHOLD_RECORD_ID"), Some(&tree.record.as_str()));
    assert!(
        vars.get("LEASEHOLD_FENCING_TOKEN")
            .is_some_and(|t| t.parse::<u64>().is_ok()),
        "{env}"
    );
    assert_eq!(vars.get("LEASEHOLD_ATTEMPT"), Some(&"1"));
    assert_eq!(vars.get("PATH").copied(), std::env::var("PATH").ok().as_deref());
    assert_eq!(vars.get("REPORT_DIR"), Some(&"/srv/reports"));
    assert_eq!(vars.get("PARTNER_API_TOKEN"), Some(&"partner-token-4"));

    let log = serve.log();
    assert!(
        log.contains("PARTNER_API_TOKEN") && !log.contains("partner-token-4"),
        "a listed secret is named in a warning, its value never:\n{log}"
    );
    assert!(
        log.contains("NOT_SET_ANYWHERE"),
        "a listed name that is not set is reported:\n{log}"
    );
}
