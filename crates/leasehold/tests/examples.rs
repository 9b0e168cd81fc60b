//! The bring-your-own-logic examples in `examples/`, each run for real against Azurite: the
//! script and the self-contained executable as `LEASEHOLD_LOGIC_COMMAND` of `leasehold serve`,
//! the web service (Node.js) as `LEASEHOLD_LOGIC_URL`, and the library example in-process. Each
//! test checks that a record runs and that its fencing token and attempt reach the logic.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::Env;
use leasehold_runtime::{TriggerMessage, TriggerQueue};
use leasehold_test_support::{Azurite, eventually, workspace_root};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

#[allow(dead_code)]
#[path = "../../../examples/library/main.rs"]
mod library;

impl Env {
    fn leasehold(&self, args: &[&str], extra: &[(&str, String)]) -> Command {
        let mut cmd = common::leasehold(args);
        cmd.envs(common::serve_vars(&self.queue, &self.container))
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(self.dir.join(format!("{}.log", args[0]))).unwrap(),
            ));
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd
    }

    /// `leasehold serve` with these settings, and a trigger for account/42 once it is up.
    async fn serve_and_trigger(&self, extra: &[(&str, String)]) -> Child {
        let child = self.leasehold(&["serve"], extra).spawn().unwrap();
        let status = self
            .leasehold(&["enqueue", "--scope", "account", "42"], &[])
            .status()
            .await
            .unwrap();
        assert!(status.success());
        child
    }

    fn output(&self) -> PathBuf {
        self.dir.join("output")
    }

    /// The lines the example logic appended to its output file, once there is one.
    async fn first_line(&self, child: Child) -> Vec<String> {
        let child = std::sync::Mutex::new(child);
        let line = eventually(Duration::from_secs(60), "the example logic to run", || async {
            let exited = child.lock().unwrap().try_wait();
            if let Ok(Some(status)) = exited {
                panic!(
                    "leasehold serve exited ({status}): {}",
                    std::fs::read_to_string(self.dir.join("serve.log")).unwrap_or_default()
                );
            }
            std::fs::read_to_string(self.output())
                .ok()
                .and_then(|t| t.lines().next().map(str::to_string))
        })
        .await;
        line.split_whitespace().map(str::to_string).collect()
    }
}

fn example(path: &str) -> PathBuf {
    workspace_root().join("examples").join(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_example_runs_as_command_logic() {
    let env = Env::new();
    let script = example("logic-script/run.sh");
    let child = env
        .serve_and_trigger(&[
            ("LEASEHOLD_LOGIC_COMMAND", script.display().to_string()),
            // The command gets only what the allow list names of the worker's environment.
            ("LEASEHOLD_LOGIC_ENV", "EXAMPLE_OUTPUT".into()),
            ("EXAMPLE_OUTPUT", env.output().display().to_string()),
        ])
        .await;
    let line = env.first_line(child).await;
    assert_eq!(line[..3], ["script", "account", "42"], "{line:?}");
    assert!(line[3].parse::<u64>().unwrap() >= 1, "a fencing token: {line:?}");
    assert_eq!(line[4], "1", "the attempt: {line:?}");
}

/// Builds the executable example with rustc alone: it needs nothing but the standard library.
fn build_executable(dir: &Path) -> PathBuf {
    let out = dir.join("sync-record");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let status = std::process::Command::new(rustc)
        .args(["--edition", "2024", "-O", "-o"])
        .arg(&out)
        .arg(example("logic-executable/main.rs"))
        .status()
        .unwrap();
    assert!(status.success(), "the example builds");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executable_example_runs_as_command_logic_and_refuses_a_stale_token() {
    let env = Env::new();
    let exe = build_executable(&env.dir);
    let state = env.dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let child = env
        .serve_and_trigger(&[
            ("LEASEHOLD_LOGIC_COMMAND", exe.display().to_string()),
            ("LEASEHOLD_LOGIC_ENV", "EXAMPLE_OUTPUT,EXAMPLE_STATE_DIR".into()),
            ("EXAMPLE_OUTPUT", env.output().display().to_string()),
            ("EXAMPLE_STATE_DIR", state.display().to_string()),
        ])
        .await;
    let line = env.first_line(child).await;
    assert_eq!(line[..3], ["executable", "account", "42"], "{line:?}");
    let token: u64 = line[3].parse().unwrap();
    assert!(token >= 1 && line[4] == "1", "{line:?}");
    // The target system now holds that token: a holder with an older one is refused.
    let stale = std::process::Command::new(&exe)
        .env_clear()
        .env("LEASEHOLD_SCOPE", "account")
        .env("LEASEHOLD_RECORD_ID", "42")
        .env("LEASEHOLD_ATTEMPT", "1")
        .env("LEASEHOLD_FENCING_TOKEN", (token - 1).to_string())
        .env("EXAMPLE_STATE_DIR", &state)
        .output()
        .unwrap();
    assert!(!stale.status.success());
    assert!(String::from_utf8_lossy(&stale.stderr).contains("refused: fencing token"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_service_example_runs_as_url_logic_and_checks_the_token() {
    let env = Env::new();
    let mut node = Command::new("node")
        .arg(example("logic-url/server.js"))
        .env("PORT", "0")
        .env("WORK_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs (Azurite needs it too)");
    let mut lines = tokio::io::BufReader::new(node.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the example service starts")
        .unwrap()
        .unwrap();
    let url = first.strip_prefix("listening on ").expect(&first).to_string();
    let child = std::sync::Mutex::new(
        env.serve_and_trigger(&[("LEASEHOLD_LOGIC_URL", url.clone())])
            .await,
    );
    let client = reqwest::Client::new();
    let state: serde_json::Value = eventually(
        Duration::from_secs(60),
        "the service to have done the work",
        || async {
            let exited = child.lock().unwrap().try_wait();
            if let Ok(Some(status)) = exited {
                panic!("leasehold serve exited ({status})");
            }
            let r = client.get(format!("{url}records/account/42")).send().await.ok()?;
            r.status().is_success().then_some(())?;
            r.json().await.ok()
        },
    )
    .await;
    let token = state["token"].as_u64().unwrap();
    assert!(token >= 1 && state["attempt"] == 1, "{state}");
    // A write with an older token is refused.
    let stale = client
        .post(&url)
        .json(&serde_json::json!({"scope": "account", "recordId": "42", "fencingToken": token - 1, "attempt": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status().as_u16(), 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_example_runs_a_record() {
    let env = Env::new();
    let (done, mut reports) = tokio::sync::mpsc::unbounded_channel();
    let stop = tokio_util::sync::CancellationToken::new();
    let connection = Azurite::shared().connection_string();
    let serving = tokio::spawn({
        let (queue, container, stop) = (env.queue.clone(), env.container.clone(), stop.clone());
        async move {
            library::serve(
                &connection,
                &queue,
                &container,
                Arc::new(library::SyncToErp { done }),
                stop,
            )
            .await
            .map_err(|e| e.to_string())
        }
    });
    let queue = common::queue(&env.queue);
    let trigger = TriggerMessage::parse("account", "42").unwrap();
    queue.put(&trigger.encode(), Duration::ZERO).await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(60), reports.recv())
        .await
        .expect("the library example ran the record")
        .unwrap();
    assert!(
        report.starts_with("synced account/42 with fencing token"),
        "{report}"
    );
    assert!(report.ends_with("attempt 1"), "{report}");
    stop.cancel();
    serving.await.unwrap().unwrap();
}
