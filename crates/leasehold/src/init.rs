//! `leasehold init -- ARGS`: a container's PID 1, in place of tini.
//!
//! It starts `leasehold ARGS` (this executable) as its one child, forwards the signals a
//! container runtime sends (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to it, reaps
//! every process the kernel hands it (a logic's stragglers, once their supervisor is gone), and
//! exits as the child did (its code, or 128 + the signal that ended it).
//!
//! Why not tini: PID 1 holds the container's environment, secrets included (the storage
//! connection string, Start's and the dashboard's keys), and tini is dumpable, so a logic command
//! running as the same user read them from `/proc/1/environ`. This process is non-dumpable like
//! every `leasehold` process (`main`'s first step), so its environment and memory are not
//! readable by the logic.

use std::ffi::OsString;
use std::process::ExitCode;

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::Signals;

/// Runs `leasehold args` under this process as PID 1 would; returns how the child ended.
pub fn run(args: Vec<OsString>) -> ExitCode {
    // Handlers first: a signal that arrives before the child exists is forwarded once it does.
    let mut signals = match Signals::new([SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2]) {
        Ok(s) => s,
        Err(e) => return fail(format!("installing signal handlers: {e}")),
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return fail(format!("locating the leasehold executable: {e}")),
    };
    let child = match std::process::Command::new(exe).args(&args).spawn() {
        Ok(child) => child,
        Err(e) => return fail(format!("starting leasehold {args:?}: {e}")),
    };
    let Ok(raw) = i32::try_from(child.id()) else {
        return fail("the child's pid is out of range".into());
    };
    let pid = Pid::from_raw(raw);
    // Reaped below, with every other child: never waited for through `child`.
    drop(child);
    std::thread::spawn(move || {
        for signal in signals.forever() {
            if let Ok(signal) = Signal::try_from(signal) {
                let _ = kill(pid, signal);
            }
        }
    });
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(p, code)) if p == pid => {
                return ExitCode::from(u8::try_from(code).unwrap_or(1));
            }
            Ok(WaitStatus::Signaled(p, signal, _)) if p == pid => {
                return ExitCode::from(128u8.saturating_add(signal as u8));
            }
            // An orphan reaped, or a stop/continue report.
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return fail(format!("waiting for children: {e}")),
        }
    }
}

fn fail(message: String) -> ExitCode {
    eprintln!("leasehold init: {message}");
    ExitCode::from(125)
}
