//! Leasehold end to end against a real Azurite: standalone `serve`, the custom handler spoken to
//! exactly as the Functions host speaks it, the bad-input table, auth and loop protection,
//! poison, shutdown, and the ops commands.
//!
//! Tests that need nothing of a process run the application in-process on port 0
//! ([`Env::start`]: `leasehold::Application`). The real binary is spawned where the process is
//! the point: signals (SIGTERM hand-back, SIGKILL of a whole host), the command line and its
//! exit codes, and the logs it writes.

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::Running;
use leasehold_runtime::{PoisonMessage, TriggerMessage, TriggerQueue, poison_queue_name};
use leasehold_test_support::{eventually, unique_name, unless_transient};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

/// [`common::post`] as a program calls Start: `Content-Type: application/json` unless the
/// headers name another (Start takes JSON only); a `content-type` of `""` sends none.
async fn post(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let is_type = |k: &str| k.eq_ignore_ascii_case("content-type");
    let typed = headers.iter().any(|(k, _)| is_type(k));
    let mut headers: Vec<(&str, &str)> = headers
        .iter()
        .copied()
        .filter(|(k, v)| !(is_type(k) && v.is_empty()))
        .collect();
    if !typed {
        headers.push(("content-type", "application/json"));
    }
    common::post(url, body, &headers).await
}

const RECORD: &str = "8f9c1d2e-0000-4000-8000-000000000001";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One isolated environment: its own queue, container and run log. `port` is the handler's
/// (chosen in advance, as the Functions host does) or, once `serve` is up, the one it bound.
struct Env {
    queue: String,
    container: String,
    dir: PathBuf,
    port: std::sync::atomic::AtomicU16,
}

impl Env {
    fn new() -> Self {
        let dir = common::scratch_dir("leasehold-app");
        Self {
            queue: unique_name("triggers"),
            container: unique_name("locks"),
            dir,
            port: free_port().into(),
        }
    }

    fn port(&self) -> u16 {
        self.port.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn runs_file(&self) -> PathBuf {
        self.dir.join("runs.log")
    }

    /// A logic command that appends "<record> <token> <start-ns>" and then does `then`.
    fn logic(&self, then: &str) -> String {
        format!(
            "echo \"$LEASEHOLD_RECORD_ID $LEASEHOLD_FENCING_TOKEN $(date +%s%N)\" >> {}; {then}",
            self.runs_file().display()
        )
    }

    /// Another process's environment on the same queue and container: its own directory
    /// (`name`, inside this one) and port.
    fn sibling(&self, name: &str) -> Env {
        let dir = self.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        Env {
            queue: self.queue.clone(),
            container: self.container.clone(),
            dir,
            port: free_port().into(),
        }
    }

    /// A logic command whose first run (of any process sharing this directory's marker) hangs
    /// until its worker dies, and whose later runs finish at once.
    fn first_run_hangs(&self) -> String {
        self.logic(&format!(
            "if [ -e {f} ]; then exit 0; fi; touch {f}; exec sleep 600",
            f = self.dir.join("first-run").display()
        ))
    }

    fn runs(&self) -> Vec<(String, u64, u128)> {
        std::fs::read_to_string(self.runs_file())
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let mut p = l.split_whitespace();
                (
                    p.next().unwrap().to_string(),
                    p.next().unwrap().parse().unwrap_or(0),
                    p.next().unwrap().parse().unwrap(),
                )
            })
            .collect()
    }

    fn command(&self, args: &[&str], extra: &[(&str, String)]) -> Command {
        let mut cmd = common::leasehold(args);
        // `serve` binds any free port and logs it (no port chosen in advance to race for).
        cmd.envs(common::serve_vars(&self.queue, &self.container))
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::File::create(self.dir.join(format!("{}.log", args[0]))).unwrap(),
            ));
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd
    }

    async fn spawn(&self, args: &[&str], extra: &[(&str, String)]) -> Child {
        let child = if args[0] == "handler" {
            self.spawn_handler(args, extra).await
        } else {
            self.command(args, extra).spawn().unwrap()
        };
        if args[0] == "serve" {
            let port = common::serve_port(&self.dir.join("serve.log")).await;
            self.port.store(port, std::sync::atomic::Ordering::SeqCst);
        }
        let url = format!(
            "http://127.0.0.1:{}/{}",
            self.port(),
            if args[0] == "serve" { "healthz" } else { "" }
        );
        common::answers(&url, "leasehold to answer").await;
        child
    }

    /// Starts the handler on the port chosen in advance (`FUNCTIONS_CUSTOMHANDLER_PORT`), as the
    /// Functions host does. Another process may take that port between its choice and the
    /// handler's bind (and then answer GET / in its stead): this returns once the log says this
    /// handler listens, and a handler that could not listen is started again on a new port.
    async fn spawn_handler(&self, args: &[&str], extra: &[(&str, String)]) -> Child {
        let mut attempts = 0;
        loop {
            let mut vars = extra.to_vec();
            vars.push(("FUNCTIONS_CUSTOMHANDLER_PORT", self.port().to_string()));
            let mut child = self.command(args, &vars).spawn().unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let status = loop {
                if self.log(args[0]).contains("custom handler listening") {
                    return child;
                }
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the handler did not listen within 30 s: {}",
                    self.log(args[0])
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let log = self.log(args[0]);
            attempts += 1;
            assert!(
                attempts < 3 && log.contains("listening on 127.0.0.1"),
                "the handler exited ({status}): {log}"
            );
            self.port.store(free_port(), std::sync::atomic::Ordering::SeqCst);
        }
    }

    async fn output(&self, args: &[&str]) -> (bool, String) {
        let out = self.command(args, &[]).output().await.unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }
}

impl Env {
    /// Builds and starts the application in-process with the same settings `command` passes
    /// the binary (and `LEASEHOLD_PORT` 0), logic commands supervised by the real binary.
    async fn start(&self, mode: leasehold::Mode, extra: &[(&str, String)]) -> Running {
        let vars = common::with(common::serve_vars(&self.queue, &self.container), extra);
        Running::start(leasehold::Settings::from_vars(vars).unwrap(), mode).await
    }

    /// [`start`](Self::start)s the custom handler (`handler`, on any free port: the test's
    /// emulated host calls it) or `serve`.
    async fn start_as(&self, handler: bool, mut extra: Vec<(&str, String)>) -> Running {
        if handler {
            extra.push(("FUNCTIONS_CUSTOMHANDLER_PORT", "0".to_string()));
            self.start(leasehold::Mode::Handler, &extra).await
        } else {
            self.start(common::standalone(), &extra).await
        }
    }
}

fn terminate(child: &Child) {
    let pid = child.id().unwrap();
    std::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_a_posted_record_and_coalesces_a_burst() {
    let env = Env::new();
    let app = env
        .start(
            common::standalone(),
            &[("LEASEHOLD_LOGIC_COMMAND", env.logic("sleep 2"))],
        )
        .await;
    let url = app.url("/api/start");

    let posted = std::time::SystemTime::now();
    let (status, body) = post(
        &url,
        &json!({"scope": "account", "recordId": RECORD}).to_string(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["enqueued"]["recordId"], RECORD);
    eventually(Duration::from_secs(20), "the first run", || async {
        (!env.runs().is_empty()).then_some(())
    })
    .await;
    let first = &env.runs()[0];
    assert_eq!(
        (first.0.as_str(), first.1),
        (RECORD, 1),
        "record id and fencing token 1"
    );
    let latency = first.2 - posted.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    println!(
        "[app] POST to logic start: {:.0} ms (same process, wake-up)",
        latency as f64 / 1e6
    );

    // A burst of 10 during the run: one more run, not ten.
    let burst_from = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    for _ in 0..10 {
        let (status, _) = post(
            &url,
            &json!({"scope": "account", "recordId": RECORD}).to_string(),
            &[],
        )
        .await;
        assert_eq!(status, 202);
    }
    let burst_to = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    eventually(
        Duration::from_secs(40),
        "a run that started after the burst",
        || async { env.runs().iter().any(|r| r.2 > burst_to).then_some(()) },
    )
    .await;
    // Let anything else that was coming arrive, then count.
    let queue = common::queue(&env.queue);
    eventually(Duration::from_secs(30), "the queue to drain", || async {
        (unless_transient(queue.approximate_len().await, "the queue's length")? == 0).then_some(())
    })
    .await;
    let runs = env.runs();
    let tokens: Vec<u64> = runs.iter().map(|r| r.1).collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens rise: {tokens:?}"
    );
    let after_burst = runs.iter().filter(|r| r.2 > burst_from).count();
    println!(
        "[app] burst of 10 triggers during a run: {after_burst} further run(s); total {}",
        runs.len()
    );
    assert!(after_burst <= 2, "a burst of 10 caused {after_burst} runs");
    app.stop().await;
}

/// (name, URL, headers, body, expected status, text the answer must contain)
type Case<'a> = (&'a str, String, Vec<(&'a str, &'a str)>, &'a str, u16, &'a str);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_and_nothing_is_enqueued() {
    let env = Env::new();
    let app_user = "0b8f6a44-2f0e-4a3b-9a61-6f2f6c0d9e01";
    let extra = [
        ("LEASEHOLD_LOGIC_COMMAND", env.logic("true")),
        ("LEASEHOLD_API_KEY", "k3y".to_string()),
        ("LEASEHOLD_ALLOWED_ORGANIZATIONS", "contoso".to_string()),
        ("LEASEHOLD_INTEGRATION_USER_IDS", app_user.to_string()),
        ("LEASEHOLD_MAX_DEPTH", "2".to_string()),
    ];
    let mut child = env.spawn(&["serve"], &extra).await;
    let url = format!("http://127.0.0.1:{}/api/start?code=k3y", env.port());
    let no_key = format!("http://127.0.0.1:{}/api/start", env.port());
    let org = ("x-ms-dynamics-organization", "contoso");
    let json_ct = ("content-type", "application/json");
    let dv = |patch: Value| {
        let mut body = json!({
            "MessageName": "Update", "PrimaryEntityName": "account", "PrimaryEntityId": RECORD,
            "OrganizationName": "contoso", "Depth": 1, "InitiatingUserId": "7d3c2b1a-0f9e-4d8c-8b7a-6f5e4d3c2b1a",
            "InputParameters": [], "OutputParameters": []
        });
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    let dv_other_org = dv(json!({"OrganizationName": "fabrikam"}));
    let dv_no_id = dv(json!({"PrimaryEntityId": "00000000-0000-0000-0000-000000000000"}));
    let dv_own_user = dv(json!({"InitiatingUserId": app_user}));
    let dv_deep = dv(json!({"Depth": 5}));
    let long_id = format!(r#"{{"recordId":"{}"}}"#, "a".repeat(200));
    let big = format!("{{\"recordId\": \"1\", \"pad\": \"{}\"}}", "x".repeat(600 * 1024));
    let cases: Vec<Case<'_>> = vec![
        (
            "no key",
            no_key.clone(),
            vec![org],
            r#"{"recordId":"1"}"#,
            401,
            "key",
        ),
        (
            "wrong key header",
            no_key.clone(),
            vec![org, ("x-functions-key", "nope")],
            r#"{"recordId":"1"}"#,
            401,
            "key",
        ),
        (
            "malformed JSON",
            url.clone(),
            vec![org, json_ct],
            r#"{"recordId": "#,
            400,
            "malformed JSON",
        ),
        (
            "empty body",
            url.clone(),
            vec![org, json_ct],
            "",
            400,
            "empty body",
        ),
        (
            "not an object",
            url.clone(),
            vec![org, json_ct],
            r#"["1"]"#,
            400,
            "JSON object",
        ),
        (
            "missing recordId",
            url.clone(),
            vec![org],
            r#"{"scope":"account"}"#,
            400,
            "recordId is missing",
        ),
        (
            "empty recordId",
            url.clone(),
            vec![org],
            r#"{"recordId":"  "}"#,
            400,
            "recordId is empty",
        ),
        (
            "numeric recordId",
            url.clone(),
            vec![org],
            r#"{"recordId":42}"#,
            400,
            "must be a string",
        ),
        (
            "unsafe recordId",
            url.clone(),
            vec![org],
            r#"{"recordId":"../etc/passwd"}"#,
            400,
            "may only hold",
        ),
        (
            "slash in recordId",
            url.clone(),
            vec![org],
            r#"{"recordId":"a/b"}"#,
            400,
            "may only hold",
        ),
        (
            "empty GUID",
            url.clone(),
            vec![org],
            r#"{"recordId":"00000000-0000-0000-0000-000000000000"}"#,
            400,
            "empty GUID",
        ),
        (
            "unsafe scope",
            url.clone(),
            vec![org],
            r#"{"scope":"a b","recordId":"1"}"#,
            400,
            "scope",
        ),
        (
            "long recordId",
            url.clone(),
            vec![org],
            &long_id,
            400,
            "longer than",
        ),
        (
            "no content type (a web page's POST needs no preflight without one)",
            url.clone(),
            vec![org, ("content-type", "")],
            "{\"recordId\": \"1\"}",
            415,
            "no Content-Type",
        ),
        (
            "form content type",
            url.clone(),
            vec![org, ("content-type", "application/x-www-form-urlencoded")],
            "recordId=1",
            415,
            "content type",
        ),
        (
            "oversize body",
            url.clone(),
            vec![org],
            &big,
            413,
            "over the limit",
        ),
        (
            "organisation not allowed",
            url.clone(),
            vec![("x-ms-dynamics-organization", "fabrikam")],
            r#"{"recordId":"1"}"#,
            403,
            "not allowed",
        ),
        (
            "dataverse: other org",
            url.clone(),
            vec![],
            &dv_other_org,
            403,
            "not allowed",
        ),
        (
            "dataverse: no record id",
            url.clone(),
            vec![],
            &dv_no_id,
            400,
            "no record id",
        ),
        (
            "dataverse: integration user",
            url.clone(),
            vec![],
            &dv_own_user,
            200,
            "integration",
        ),
        (
            "dataverse: too deep",
            url.clone(),
            vec![],
            &dv_deep,
            200,
            "Depth 5",
        ),
    ];
    assert!(cases.len() >= 15);
    for (name, url, headers, body, status, expect) in &cases {
        let (got, answer) = post(url, body, headers).await;
        let text = answer.to_string();
        assert_eq!(got, *status, "{name}: {text}");
        assert!(text.contains(expect), "{name}: expected {expect:?} in {text}");
        assert!(!text.contains("k3y"), "{name}: the key leaked: {text}");
    }
    // GET is not allowed either.
    let r = reqwest::Client::new().get(&url).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);

    // A sentinel: the only thing that may run. Anything enqueued by the cases above would run too.
    let (status, _) = post(&url, r#"{"recordId":"sentinel"}"#, &[org]).await;
    assert_eq!(status, 202);
    eventually(Duration::from_secs(20), "the sentinel's run", || async {
        (!env.runs().is_empty()).then_some(())
    })
    .await;
    let queue = common::queue(&env.queue);
    eventually(Duration::from_secs(20), "the queue to drain", || async {
        (unless_transient(queue.approximate_len().await, "the queue's length")? == 0).then_some(())
    })
    .await;
    let records: Vec<String> = env.runs().into_iter().map(|r| r.0).collect();
    assert_eq!(records, ["sentinel"], "only the sentinel was enqueued");
    assert!(!env.log("serve").contains("k3y"), "the key appears in the logs");
    terminate(&child);
    child.wait().await.unwrap();
}

/// The custom handler, spoken to exactly as the Functions host does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_handler_speaks_the_host_protocol() {
    let env = Env::new();
    // On the port chosen in advance (FUNCTIONS_CUSTOMHANDLER_PORT), as the host starts it.
    let mut child = {
        let started = std::time::Instant::now();
        let child = env
            .spawn(
                &["handler", "--log-format", "json"],
                &[(
                    "LEASEHOLD_LOGIC_COMMAND",
                    env.logic("test \"$LEASEHOLD_RECORD_ID\" != fails"),
                )],
            )
            .await;
        println!(
            "[app] handler ready (GET / answered) {:.0?} after start",
            started.elapsed()
        );
        child
    };
    let base = format!("http://127.0.0.1:{}", env.port());
    let client = reqwest::Client::new();
    let invoke = |function: &str, payload: Value| {
        let (client, url) = (client.clone(), format!("{base}/{function}"));
        async move {
            let r = client
                .post(url)
                .header("X-Azure-Functions-InvocationId", uuid::Uuid::new_v4().to_string())
                .json(&payload)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let http_payload = |body: Option<&str>| {
        let mut req = json!({
            "Url": format!("{base}/api/start"), "Method": "POST", "Query": {},
            "Headers": { "Content-Type": ["application/json"] }, "Params": {}, "Identities": []
        });
        if let Some(b) = body {
            req["Body"] = json!(b);
        }
        json!({ "Data": { "req": req }, "Metadata": { "sys": { "MethodName": "Start" } } })
    };

    // Start: accepted → caller's 202 in Outputs.res, the trigger in the queue output.
    let (status, r) = invoke(
        "Start",
        http_payload(Some(&json!({"scope": "account", "recordId": RECORD}).to_string())),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(r["Outputs"]["res"]["statusCode"], 202);
    let queued = TriggerMessage::from_json(r["Outputs"]["message"].as_str().unwrap()).unwrap();
    assert_eq!(
        (queued.scope.as_str(), queued.record_id.as_str()),
        ("account", RECORD)
    );
    // Start: bad input → host still gets 200, the caller gets 400, nothing to enqueue.
    for bad in [Some("{nope"), None] {
        let (status, r) = invoke("Start", http_payload(bad)).await;
        assert_eq!(status, 200);
        assert_eq!(r["Outputs"]["res"]["statusCode"], 400, "{r}");
        assert!(r["Outputs"].get("message").is_none());
    }

    // Worker: the message as the host passes it, double-encoded, DequeueCount as a string.
    let worker = |data: Value, dequeue: Value| {
        json!({
            "Data": { "trigger": data },
            "Metadata": { "DequeueCount": dequeue, "Id": "\"9b1f\"", "PopReceipt": "\"AgAA\"",
                          "InsertionTime": "2026-11-22T03:00:00+00:00", "sys": { "MethodName": "Worker" } }
        })
    };
    let (status, r) = invoke("Worker", worker(json!(queued.to_json()), json!("1"))).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["ReturnValue"]["outcome"], "completed");
    assert_eq!(env.runs().len(), 1);
    // Plain object, DequeueCount as a number.
    let (status, _) = invoke(
        "Worker",
        worker(json!({"scope": "account", "recordId": RECORD}), json!(2)),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        env.runs().iter().map(|r| r.1).collect::<Vec<_>>(),
        [1, 2],
        "fencing tokens rise"
    );
    // Failing logic: the delivery's watchdog becomes its retry (visible after the retry delay),
    // so the invocation succeeds and the host deletes its own message; the reason is logged.
    let (status, r) = invoke(
        "Worker",
        worker(
            json!(TriggerMessage::parse("account", "fails").unwrap().to_json()),
            json!(1),
        ),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["ReturnValue"]["outcome"], "retrying", "{r}");
    assert!(
        r["Logs"][0].as_str().unwrap().contains("exited with code 1"),
        "{r}"
    );
    let triggers = common::queue(&env.queue);
    let retry = eventually(Duration::from_secs(15), "the retry to become visible", || async {
        let got = unless_transient(triggers.get(1, Duration::from_secs(60)).await, "taking the retry")?;
        got.into_iter().next()
    })
    .await;
    let retry = TriggerMessage::decode(&retry.body).unwrap();
    assert_eq!(
        (retry.kind, retry.record_id.as_str(), retry.prior_attempts),
        (leasehold_runtime::TriggerKind::Watchdog, "fails", 1)
    );
    // Unreadable message: poisoned with its reason, invocation succeeds (nothing silently dropped).
    let (status, _) = invoke("Worker", worker(json!("not a trigger"), json!(1))).await;
    assert_eq!(status, 200);
    let poison = common::queue(&poison_queue_name(&env.queue));
    let got = poison.get(1, Duration::from_secs(30)).await.unwrap();
    let poisoned = PoisonMessage::decode(&got[0].body).unwrap();
    assert!(
        poisoned.reason().contains("not a trigger message"),
        "{poisoned:?}"
    );
    assert!(poisoned.body().contains("not a trigger"), "{poisoned:?}");
    // Unknown function.
    assert_eq!(invoke("Nope", json!({})).await.0, 404);
    // JSON logs, one line per record outcome, in the delivery's span (record, attempt, fencing
    // token) instead of repeating them on each event.
    terminate(&child);
    assert!(child.wait().await.unwrap().success());
    let log = env.log("handler");
    let outcome_line = log
        .lines()
        .find(|l| l.contains("record run completed"))
        .expect("an outcome line");
    let parsed: Value = serde_json::from_str(outcome_line).expect("JSON log line");
    let span = &parsed["span"];
    assert_eq!(
        (&span["name"], &span["record"], &span["scope"], &span["attempt"]),
        (&json!("delivery"), &json!(RECORD), &json!("account"), &json!(1)),
        "{parsed}"
    );
    assert!(
        span["fencing_token"].as_u64().is_some() && parsed.get("run_ms").is_some(),
        "{parsed}"
    );
    assert!(
        parsed.get("record").is_none(),
        "not repeated on the event: {parsed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_trigger_is_poisoned_and_shutdown_releases_the_lease() {
    let env = Env::new();
    let extra = [
        (
            "LEASEHOLD_LOGIC_COMMAND",
            env.logic("test \"$LEASEHOLD_RECORD_ID\" != doomed && sleep 600"),
        ),
        ("LEASEHOLD_MAX_DEQUEUE_COUNT", "2".to_string()),
        ("LEASEHOLD_SHUTDOWN_GRACE_SECONDS", "1".to_string()),
    ];
    let mut child = env.spawn(&["serve"], &extra).await;
    let (ok, out) = env.output(&["enqueue", "--scope", "account", "doomed"]).await;
    assert!(ok, "{out}");
    // Given up after 2 deliveries, with a sweep (run once more, for triggers that may have
    // coalesced onto it); the sweep fails too and is given up in turn, and the next, conditional
    // sweep finds no marker: the chain ends with two entries in the poison queue.
    let poison = common::queue(&poison_queue_name(&env.queue));
    let triggers = common::queue(&env.queue);
    eventually(
        Duration::from_secs(90),
        "the failing trigger and its sweep in the poison queue, nothing left to run",
        || async {
            let poisoned = unless_transient(poison.approximate_len().await, "the poison queue's length")?;
            let waiting = unless_transient(triggers.approximate_len().await, "the queue's length")?;
            (poisoned == 2 && waiting == 0).then_some(())
        },
    )
    .await;
    let got = poison.get(2, Duration::from_secs(30)).await.unwrap();
    let poisoned: Vec<PoisonMessage> = got
        .iter()
        .map(|m| PoisonMessage::decode(&m.body).unwrap())
        .collect();
    for entry in &poisoned {
        assert!(entry.reason().contains("gave up after 2 deliveries"), "{entry:?}");
        assert_eq!(
            entry.trigger.as_ref().map(|t| t.record_id.as_str()),
            Some("doomed")
        );
    }
    let mut kinds: Vec<_> = poisoned
        .iter()
        .map(|e| e.trigger.as_ref().unwrap().kind)
        .collect();
    kinds.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(
        kinds,
        [
            leasehold_runtime::TriggerKind::Sweep,
            leasehold_runtime::TriggerKind::Trigger
        ]
    );

    // A long run, then SIGTERM: the run is cancelled, its lease released, its trigger handed back.
    let (ok, _) = env.output(&["enqueue", "--scope", "account", RECORD]).await;
    assert!(ok);
    eventually(Duration::from_secs(20), "the long run to start", || async {
        env.runs().iter().any(|r| r.0 == RECORD).then_some(())
    })
    .await;
    let (_, status) = env
        .output(&["status", "--json", "--scope", "account", RECORD])
        .await;
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["record"]["held"], true, "{status}");
    terminate(&child);
    assert!(child.wait().await.unwrap().success());
    let (_, status) = env
        .output(&["status", "--json", "--scope", "account", RECORD])
        .await;
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["record"]["held"], false,
        "lease released on shutdown: {status}"
    );
    assert_eq!(
        status["queue"]["approximateMessages"], 1,
        "the trigger was handed back: {status}"
    );
    assert_eq!(status["poison"]["approximateMessages"], 2);
    assert!(status["record"]["generation"].as_u64().unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_commands_and_clear_configuration_errors() {
    let env = Env::new();
    let (ok, out) = env.output(&["status", "--scope", "account", RECORD]).await;
    assert!(ok, "{out}");
    assert!(
        out.contains("free (never used)") && out.contains("retrigger   none"),
        "{out}"
    );
    let (ok, out) = env
        .output(&["break", "--scope", "account", RECORD, "--reason", "test"])
        .await;
    assert!(ok && out.contains("at most 30 s"), "{out}");
    let (ok, out) = env
        .output(&["break", "--scope", "account", RECORD, "--reason", "dead", "--now"])
        .await;
    assert!(ok && out.contains("free now"), "{out}");
    // A bad setting names the variable and exits non-zero.
    let out = env
        .command(&["serve"], &[("LEASEHOLD_LEASE_SECONDS", "5".into())])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("LEASEHOLD_LEASE_SECONDS must be from 15 to 60"),
        "{err}"
    );
    // No logic configured: says how to configure it.
    let out = env.command(&["serve"], &[]).output().await.unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("LEASEHOLD_LOGIC_COMMAND") && err.contains("--demo"),
        "{err}"
    );
}

/// Start answers 503 (and the caller may retry) when the queue cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_answers_503_when_the_queue_is_unreachable() {
    let env = Env::new();
    let closed = free_port();
    let nowhere = format!(
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={};BlobEndpoint=http://127.0.0.1:{closed}/devstoreaccount1;QueueEndpoint=http://127.0.0.1:{closed}/devstoreaccount1;",
        leasehold_storage::EMULATOR_KEY
    );
    let app = env
        .start(
            common::standalone(),
            &[
                ("LEASEHOLD_LOGIC_COMMAND", "true".into()),
                ("AzureWebJobsStorage", nowhere),
            ],
        )
        .await;
    let url = app.url("/api/start");
    let (status, body) = post(&url, r#"{"recordId":"1"}"#, &[]).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("cannot be reached"),
        "{body}"
    );
    assert!(!body.to_string().contains(leasehold_storage::EMULATOR_KEY));
    app.stop().await;
}

/// Handler mode under a burst: the host delivers several triggers for a record while its run is
/// in progress; they coalesce into one retrigger on the real queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handler_mode_coalesces_a_burst() {
    let env = Env::new();
    let gate = env.dir.join("gate");
    let logic = env.logic(&format!("while [ ! -e {} ]; do sleep 0.05; done", gate.display()));
    let app = env
        .start(
            leasehold::Mode::Handler,
            &[
                ("LEASEHOLD_LOGIC_COMMAND", logic),
                ("FUNCTIONS_CUSTOMHANDLER_PORT", "0".into()),
            ],
        )
        .await;
    let url = app.url("/Worker");
    let invocation = json!({
        "Data": { "trigger": TriggerMessage::parse("account", RECORD).unwrap().to_json() },
        "Metadata": { "DequeueCount": 1 }
    });
    let client = reqwest::Client::new();
    let first = {
        let (client, url, invocation) = (client.clone(), url.clone(), invocation.clone());
        tokio::spawn(async move {
            client
                .post(url)
                .json(&invocation)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        })
    };
    eventually(Duration::from_secs(20), "the first run to start", || async {
        (!env.runs().is_empty()).then_some(())
    })
    .await;
    for _ in 0..5 {
        let r: Value = client
            .post(&url)
            .json(&invocation)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["ReturnValue"]["outcome"], "coalesced", "{r}");
    }
    std::fs::write(&gate, b"").unwrap();
    let r = first.await.unwrap();
    assert_eq!(r["ReturnValue"]["outcome"], "completed", "{r}");
    let queue = common::queue(&env.queue);
    let waiting = queue.get(32, Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        waiting.len(),
        1,
        "five triggers during the run left exactly one retrigger"
    );
    let retrigger = TriggerMessage::decode(&waiting[0].body).unwrap();
    assert_eq!(retrigger.kind, leasehold_runtime::TriggerKind::Retrigger);
    assert_eq!(env.runs().len(), 1);
    app.stop().await;
}

/// A whole Functions host instance dies mid-run: the handler, the host and the logic are gone,
/// and the host's message stays hidden for 10 minutes (nothing deletes or updates it). The
/// delivery's watchdog must bring the record back on another instance within the lease duration
/// + 15 s. The host is emulated as `PROTOCOLS.md` describes it: messages taken with a 10-minute
/// visibility, base64 decoded, passed double-encoded with the metadata as strings; deleted on a
/// 2xx, made visible again after 5 s otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_functions_host_is_recovered_by_the_watchdog_within_a_lease_and_15_s() {
    const LEASE_SECONDS: u64 = 15;
    let env = Env::new();
    let other = env.sibling("second-host");
    // The first run hangs (until its worker dies); later runs finish at once.
    let logic = env.first_run_hangs();
    let settings = [
        ("LEASEHOLD_LOGIC_COMMAND", logic),
        ("LEASEHOLD_LEASE_SECONDS", LEASE_SECONDS.to_string()),
        ("LEASEHOLD_LOG_FORMAT", "json".to_string()),
    ];
    // Each on a port chosen in advance (FUNCTIONS_CUSTOMHANDLER_PORT), as the host starts it.
    let mut dying = env.spawn(&["handler"], &settings).await;
    let mut survivor = other.spawn(&["handler"], &settings).await;
    let queue = common::queue(&env.queue);
    queue
        .put(
            &TriggerMessage::parse("account", RECORD).unwrap().encode(),
            Duration::ZERO,
        )
        .await
        .unwrap();

    // Host 1 takes the message for 10 minutes and invokes its handler; it never answers.
    let taken = queue.get(1, Duration::from_secs(600)).await.unwrap();
    assert_eq!(taken.len(), 1);
    let in_flight = tokio::spawn(invoke_as_host(env.port(), taken[0].clone()));
    eventually(Duration::from_secs(20), "the first run to start", || async {
        (env.runs().len() == 1).then_some(())
    })
    .await;
    // Let the lease be renewed (every 5 s) once, then the whole instance dies.
    tokio::time::sleep(Duration::from_secs(7)).await;
    dying.start_kill().unwrap();
    dying.wait().await.unwrap();
    in_flight.abort();
    let died = std::time::Instant::now();

    // Host 2 polls every second, as host.json's maxPollingInterval of 2 s allows.
    let host = tokio::spawn({
        let queue = common::queue(&env.queue);
        let port = other.port();
        async move {
            loop {
                for m in queue.get(16, Duration::from_secs(600)).await.unwrap_or_default() {
                    let status = invoke_as_host(port, m.clone()).await;
                    if (200..300).contains(&status) {
                        queue.delete(&m.id, &m.pop_receipt).await.unwrap();
                    } else {
                        let _ = queue
                            .set_visibility(&m.id, &m.pop_receipt, &m.body, Duration::from_secs(5))
                            .await;
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    });
    let bound = Duration::from_secs(LEASE_SECONDS + 15);
    eventually(
        bound + Duration::from_secs(5),
        "the record to run again",
        || async { (env.runs().len() >= 2).then_some(()) },
    )
    .await;
    let recovered = died.elapsed();
    host.abort();
    println!("whole-host death: the record ran again {recovered:.1?} after the host died (bound {bound:?})");
    assert!(
        recovered <= bound,
        "recovered after {recovered:?}, bound {bound:?}"
    );
    let runs = env.runs();
    assert!(runs[1].1 > runs[0].1, "a new fencing token: {runs:?}");
    // The host's own message was not what brought it back: it is still hidden.
    assert!(
        queue.get(1, Duration::from_secs(1)).await.unwrap().is_empty(),
        "the dead host's message stays hidden"
    );
    terminate(&survivor);
    survivor.wait().await.unwrap();
}

/// Invokes `POST /Worker` as the Functions host does for a queue message; returns the status.
async fn invoke_as_host(port: u16, m: leasehold_runtime::Received) -> u16 {
    invoke_at(&format!("http://127.0.0.1:{port}/Worker"), m).await
}

/// What a run-later scenario's logic is: a URL (the test's own server) or a command.
enum LaterLogic {
    /// Answers 429 with `Retry-After: 3` to its first ten calls, then 200.
    Url,
    /// Exits 75 with `Retry-After: 2` on stderr on its first two runs, then 0.
    Command,
}

/// Logic that asks to be run later (issue 24), end to end against Azurite in both modes: a URL
/// answering 429 with `Retry-After: 3` ten times and a command exiting 75 twice each run again
/// after the delay they asked for (not sooner, and soon after), until they complete; none is
/// poisoned, although the poison limit is 2 deliveries. Under the emulated Functions host every
/// invocation has `DequeueCount` 1: a deferral never raises the host's count. The four
/// scenarios run side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn logic_asking_to_run_later_runs_again_then_and_is_never_poisoned() {
    let (a, b, c, d) = tokio::join!(
        run_later_scenario(false, LaterLogic::Url),
        run_later_scenario(true, LaterLogic::Url),
        run_later_scenario(false, LaterLogic::Command),
        run_later_scenario(true, LaterLogic::Command),
    );
    for line in [a, b, c, d] {
        println!("[run later] {line}");
    }
}

async fn run_later_scenario(handler: bool, logic: LaterLogic) -> String {
    let env = Env::new();
    let (starts, setting, asks, delay): (Box<dyn Fn() -> Vec<u128> + Send>, _, usize, u64) = match logic {
        LaterLogic::Url => {
            let calls: std::sync::Arc<std::sync::Mutex<Vec<u128>>> = Default::default();
            let seen = calls.clone();
            let app = axum::Router::new().route(
                "/run",
                axum::routing::post(move || {
                    let seen = seen.clone();
                    async move {
                        let mut calls = seen.lock().unwrap();
                        calls.push(now_ns());
                        if calls.len() <= 10 {
                            (
                                axum::http::StatusCode::TOO_MANY_REQUESTS,
                                [(axum::http::header::RETRY_AFTER, "3")],
                                "slow down",
                            )
                        } else {
                            (
                                axum::http::StatusCode::OK,
                                [(axum::http::header::RETRY_AFTER, "0")],
                                "done",
                            )
                        }
                    }
                }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/run", listener.local_addr().unwrap());
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
            (
                Box::new(move || calls.lock().unwrap().clone()),
                ("LEASEHOLD_LOGIC_URL", url),
                10,
                3,
            )
        }
        LaterLogic::Command => {
            let runs = env.runs_file();
            let command = env.logic(&format!(
                "if [ $(wc -l < {}) -le 2 ]; then echo 'throttled' >&2; echo 'Retry-After: 2' >&2; exit 75; fi",
                runs.display()
            ));
            let file = env.runs_file();
            (
                Box::new(move || {
                    std::fs::read_to_string(&file)
                        .unwrap_or_default()
                        .lines()
                        .map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap())
                        .collect()
                }),
                ("LEASEHOLD_LOGIC_COMMAND", command),
                2,
                2,
            )
        }
    };
    let app = env
        .start_as(
            handler,
            vec![setting, ("LEASEHOLD_MAX_DEQUEUE_COUNT", "2".to_string())],
        )
        .await;
    let queue = common::queue(&env.queue);
    let counts: std::sync::Arc<std::sync::Mutex<Vec<u32>>> = Default::default();
    let host = handler.then(|| emulated_host(&env.queue, app.url("/Worker"), counts.clone()));
    queue
        .put(
            &TriggerMessage::parse("account", RECORD).unwrap().encode(),
            Duration::ZERO,
        )
        .await
        .unwrap();
    let mode_name = if handler { "handler" } else { "serve" };
    eventually(
        Duration::from_secs(90),
        "the logic to run until it completes, and the queue to drain",
        || async {
            let waiting = unless_transient(queue.approximate_len().await, "the queue's length")?;
            (starts().len() == asks + 1 && waiting == 0).then_some(())
        },
    )
    .await;
    let starts = starts();
    let gaps: Vec<f64> = starts.windows(2).map(|w| (w[1] - w[0]) as f64 / 1e9).collect();
    for gap in &gaps {
        assert!(
            *gap >= delay as f64 && *gap < delay as f64 + 8.0,
            "{mode_name}: runs {gaps:?} s apart, asked {delay} s"
        );
    }
    let poison = common::queue(&poison_queue_name(&env.queue));
    assert_eq!(
        poison.approximate_len().await.unwrap(),
        0,
        "{mode_name}: a deferral is never poisoned"
    );
    if !handler {
        // The deferrals are counted, with their delays (the recorder is the process's: other
        // tests' deliveries count too, never fewer).
        let metrics = common::get(&app.url("/metrics"), &[]).await.text().await.unwrap();
        let deferred = metrics
            .lines()
            .find(|l| l.starts_with("leasehold_deliveries_total{outcome=\"deferred\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        assert!(deferred >= asks as f64, "{metrics}");
        assert!(metrics.contains("leasehold_deferral_seconds_bucket"), "{metrics}");
    }
    if let Some(host) = host {
        host.abort();
        let counts = counts.lock().unwrap().clone();
        assert!(
            counts.len() > asks && counts.iter().all(|c| *c == 1),
            "{mode_name}: every invocation is a first delivery: {counts:?}"
        );
    }
    app.stop().await;
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    format!(
        "{mode_name}, {} logic: {asks} requests to run later after {delay} s, then completed; runs {mean:.2} s apart on average (min {:.2}, max {:.2}); nothing poisoned",
        if matches!(logic, LaterLogic::Url) {
            "URL"
        } else {
            "command"
        },
        gaps.iter().copied().fold(f64::MAX, f64::min),
        gaps.iter().copied().fold(0.0, f64::max),
    )
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Invokes `POST /Worker` at `url` as the Functions host does for a queue message; returns the
/// status.
async fn invoke_at(url: &str, m: leasehold_runtime::Received) -> u16 {
    use base64::Engine;
    let text = String::from_utf8(base64::engine::general_purpose::STANDARD.decode(&m.body).unwrap()).unwrap();
    let invocation = json!({
        "Data": { "trigger": text },
        "Metadata": {
            "DequeueCount": m.dequeue_count.to_string(),
            "Id": format!("\"{}\"", m.id),
            "PopReceipt": format!("\"{}\"", m.pop_receipt),
            "sys": { "MethodName": "Worker" }
        }
    });
    match reqwest::Client::new().post(url).json(&invocation).send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 599,
    }
}

/// The Functions host, emulated: takes messages for 10 minutes, invokes the handler at `url`
/// (each invocation concurrently, as the host does up to its batch size), deletes a message on
/// a 2xx and shows it again after 5 s otherwise; polls every second. Every dequeue count it
/// saw goes to `counts`.
fn emulated_host(
    queue: &str,
    url: String,
    counts: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
) -> tokio::task::JoinHandle<()> {
    let queue = common::queue(queue);
    tokio::spawn(async move {
        let queue = std::sync::Arc::new(queue);
        loop {
            for m in queue.get(16, Duration::from_secs(600)).await.unwrap_or_default() {
                counts.lock().unwrap().push(m.dequeue_count);
                let (queue, url) = (queue.clone(), url.clone());
                tokio::spawn(async move {
                    let status = invoke_at(&url, m.clone()).await;
                    if (200..300).contains(&status) {
                        let _ = queue.delete(&m.id, &m.pop_receipt).await;
                    } else {
                        let _ = queue
                            .set_visibility(&m.id, &m.pop_receipt, &m.body, Duration::from_secs(5))
                            .await;
                    }
                });
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// Supersede, end to end against Azurite in both modes (serve, and the handler under the
/// emulated Functions host), side by side: a trigger during a run of a superseding scope stops
/// the run — its command's whole process tree, a background child included, is gone — and the
/// record runs again with a higher fencing token, within a renewal interval and the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trigger_during_a_superseding_run_stops_its_process_tree_and_runs_the_record_again() {
    let (a, b) = tokio::join!(supersede_scenario(false), supersede_scenario(true));
    for line in [a, b] {
        println!("[supersede] {line}");
    }
}

async fn supersede_scenario(handler: bool) -> String {
    let env = Env::new();
    let dir = env.dir.clone();
    // The first run leaves a child in the background and waits; later runs finish at once.
    let logic = env.logic(&format!(
        "if [ \"$LEASEHOLD_FENCING_TOKEN\" -ge 2 ]; then exit 0; fi; \
         sleep 600 & echo $! > {d}/child; echo $$ > {d}/shell; wait",
        d = dir.display()
    ));
    let extra = vec![
        ("LEASEHOLD_LOGIC_COMMAND", logic),
        ("LEASEHOLD_RUN_POLICY", "coalesce,account=supersede".to_string()),
        ("LEASEHOLD_LEASE_SECONDS", "15".to_string()),
    ];
    let app = env.start_as(handler, extra).await;
    let counts: std::sync::Arc<std::sync::Mutex<Vec<u32>>> = Default::default();
    let host = handler.then(|| emulated_host(&env.queue, app.url("/Worker"), counts.clone()));
    let queue = common::queue(&env.queue);
    let trigger = TriggerMessage::parse("account", RECORD).unwrap().encode();
    queue.put(&trigger, Duration::ZERO).await.unwrap();
    let pid =
        |name: &str| -> Option<u32> { std::fs::read_to_string(dir.join(name)).ok()?.trim().parse().ok() };
    let (shell, child) = eventually(Duration::from_secs(30), "the first run and its child", || async {
        Some((pid("shell")?, pid("child")?))
    })
    .await;
    assert!(alive(shell) && alive(child));
    let sent = std::time::Instant::now();
    queue.put(&trigger, Duration::ZERO).await.unwrap();
    eventually(
        Duration::from_secs(40),
        "a second run, with a higher token",
        || async { (env.runs().len() >= 2).then_some(()) },
    )
    .await;
    let rerun = sent.elapsed();
    let runs = env.runs();
    assert_eq!((runs[0].1, runs[1].1), (1, 2), "{runs:?}");
    assert!(
        !alive(shell) && !alive(child),
        "the stopped run's process tree is gone (shell {shell}, child {child})"
    );
    let mode_name = if handler { "handler" } else { "serve" };
    eventually(Duration::from_secs(30), "the queue to drain", || async {
        (unless_transient(queue.approximate_len().await, "the queue's length")? == 0).then_some(())
    })
    .await;
    assert_eq!(env.runs().len(), 2, "{mode_name}: one run more, not more");
    if let Some(host) = host {
        host.abort();
    }
    app.stop().await;
    format!(
        "{mode_name}: a trigger during a run stopped it and its background child; the record ran again {:.1} s after the trigger (lease 15 s, renewed every 5 s)",
        rerun.as_secs_f64()
    )
}

/// Whether `pid` is a live process (not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            None | Some('Z' | 'X' | 'x')
        )
    })
}

/// Debounce, end to end against Azurite in both modes (serve, and the handler under the emulated
/// Functions host), side by side: six triggers for one record 0.4 s apart through Start, in a
/// scope that debounces (Q 2 s, M 30 s), give exactly one run, which starts at least Q after the
/// last trigger and soon after (waiters look every Q: within 2Q and the polls); a record of a
/// scope that does not debounce, triggered mid-burst, runs at once. Nothing is poisoned, and
/// under the emulated host every invocation has `DequeueCount` 1 (a waiter's wait never raises
/// the host's count).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_with_debounce_gives_one_run() {
    let (a, b) = tokio::join!(debounce_scenario(false), debounce_scenario(true));
    for line in [a, b] {
        println!("[debounce] {line}");
    }
}

async fn debounce_scenario(handler: bool) -> String {
    const QUIET: u64 = 2;
    const OTHER: &str = "8f9c1d2e-0000-4000-8000-000000000002";
    let env = Env::new();
    let extra = vec![
        ("LEASEHOLD_LOGIC_COMMAND", env.logic("true")),
        ("LEASEHOLD_DEBOUNCE_SECONDS", format!("0,account={QUIET}")),
        ("LEASEHOLD_DEBOUNCE_MAX_SECONDS", "30".to_string()),
        ("LEASEHOLD_MAX_DEQUEUE_COUNT", "2".to_string()),
    ];
    let app = env.start_as(handler, extra).await;
    let queue = common::queue(&env.queue);
    let counts: std::sync::Arc<std::sync::Mutex<Vec<u32>>> = Default::default();
    let host = handler.then(|| emulated_host(&env.queue, app.url("/Worker"), counts.clone()));
    let mode_name = if handler { "handler" } else { "serve" };
    // Start as a program calls it: `serve`'s endpoint, or the handler's Start function as the
    // host invokes it, the trigger then put by the host's queue output binding.
    let start = |scope: &'static str, record: &'static str| {
        let (app_url, queue) = (app.url(""), &queue);
        async move {
            let body = json!({"scope": scope, "recordId": record}).to_string();
            if !handler {
                let (status, answer) = post(&format!("{app_url}/api/start"), &body, &[]).await;
                assert_eq!(status, 202, "{answer}");
                return;
            }
            let invocation = json!({
                "Data": { "req": {
                    "Url": format!("{app_url}/api/start"), "Method": "POST", "Query": {},
                    "Headers": { "Content-Type": ["application/json"] }, "Params": {},
                    "Identities": [], "Body": body
                } },
                "Metadata": { "sys": { "MethodName": "Start" } }
            });
            let r: Value = reqwest::Client::new()
                .post(format!("{app_url}/Start"))
                .json(&invocation)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(r["Outputs"]["res"]["statusCode"], 202, "{r}");
            let message = TriggerMessage::from_json(r["Outputs"]["message"].as_str().unwrap()).unwrap();
            queue.put(&message.encode(), Duration::ZERO).await.unwrap();
        }
    };

    let mut last = 0;
    let mut other_sent = 0;
    for i in 0..6 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        start("account", RECORD).await;
        last = now_ns();
        if i == 2 {
            other_sent = now_ns();
            start("contact", OTHER).await;
        }
    }
    let first_run = |record: &str| env.runs().into_iter().find(|r| r.0 == record).map(|r| r.2);
    let other_ran = eventually(
        Duration::from_secs(20),
        "the record of a scope that does not debounce to run",
        || async { first_run(OTHER) },
    )
    .await;
    let ran = eventually(Duration::from_secs(30), "the debounced record to run", || async {
        first_run(RECORD)
    })
    .await;
    eventually(Duration::from_secs(30), "the queue to drain", || async {
        (unless_transient(queue.approximate_len().await, "the queue's length")? == 0).then_some(())
    })
    .await;
    let runs: Vec<_> = env.runs().into_iter().filter(|r| r.0 == RECORD).collect();
    assert_eq!(runs.len(), 1, "{mode_name}: one run for the burst: {runs:?}");
    let after = (ran as f64 - last as f64) / 1e9;
    let bound = 2.0 * QUIET as f64 + 5.0;
    assert!(
        after >= QUIET as f64 && after < bound,
        "{mode_name}: the run started {after:.2} s after the last trigger (quiet period {QUIET} s, bound {bound} s)"
    );
    let other_after = (other_ran as f64 - other_sent as f64) / 1e9;
    assert!(
        other_after < 5.0 && other_ran < ran,
        "{mode_name}: a scope that does not debounce runs at once ({other_after:.2} s), before the debounced one"
    );
    assert_eq!(
        env.runs().iter().filter(|r| r.0 == OTHER).count(),
        1,
        "{mode_name}: {:?}",
        env.runs()
    );
    let poison = common::queue(&poison_queue_name(&env.queue));
    assert_eq!(
        poison.approximate_len().await.unwrap(),
        0,
        "{mode_name}: nothing is poisoned"
    );
    let mut invocations = 0;
    if let Some(host) = host {
        host.abort();
        let counts = counts.lock().unwrap().clone();
        invocations = counts.len();
        assert!(
            counts.len() >= 7 && counts.iter().all(|c| *c == 1),
            "{mode_name}: every invocation is a first delivery: {counts:?}"
        );
    } else {
        // The joins and the wait are counted (the recorder is the process's: the other mode's
        // deliveries count too, never fewer).
        let metrics = common::get(&app.url("/metrics"), &[]).await.text().await.unwrap();
        let outcome = |name: &str| {
            metrics
                .lines()
                .find(|l| l.starts_with(&format!("leasehold_deliveries_total{{outcome=\"{name}\"}}")))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        assert!(
            outcome("debounced") >= 5.0 && outcome("waiting") >= 1.0,
            "{metrics}"
        );
    }
    app.stop().await;
    format!(
        "{mode_name}: 6 triggers 0.4 s apart, Q {QUIET} s: one run, {after:.2} s after the last trigger; another scope's record ran {other_after:.2} s after its trigger{}; nothing poisoned",
        if handler {
            format!("; {invocations} host invocations, all DequeueCount 1")
        } else {
            String::new()
        }
    )
}

/// A downstream like a CRM's Web API under its service-protection limits: each call takes
/// `work`; past `limit` calls at once it answers 429 with `Retry-After: 1` at once. It notes
/// every call: the record, when, by which worker (`/<worker>/run`) and its answer.
/// A call to [`Throttled`]: the record, when, by which worker, and the status answered.
type Call = (String, std::time::Instant, String, u16);

#[derive(Clone, Default)]
struct Throttled {
    calls: std::sync::Arc<std::sync::Mutex<Vec<Call>>>,
    in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Throttled {
    async fn serve(limit: usize, work: Duration, retry_after: u64) -> (Self, String) {
        use std::sync::atomic::Ordering;
        let this = Self::default();
        let state = this.clone();
        let app = axum::Router::new().route(
            "/{worker}/run",
            axum::routing::post(
                move |axum::extract::Path(worker): axum::extract::Path<String>, body: axum::Json<Value>| {
                    let state = state.clone();
                    async move {
                        let record = body["recordId"].as_str().unwrap_or("").to_string();
                        let now = std::time::Instant::now();
                        let busy = state.in_flight.fetch_add(1, Ordering::SeqCst) >= limit;
                        let status = if busy {
                            429
                        } else {
                            tokio::time::sleep(work).await;
                            200
                        };
                        state.in_flight.fetch_sub(1, Ordering::SeqCst);
                        state.calls.lock().unwrap().push((record, now, worker, status));
                        (
                            axum::http::StatusCode::from_u16(status).unwrap(),
                            [(axum::http::header::RETRY_AFTER, retry_after.to_string())],
                            "",
                        )
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (this, base)
    }

    /// When each record first succeeded.
    fn done(&self) -> std::collections::HashMap<String, std::time::Instant> {
        let mut done = std::collections::HashMap::new();
        for (record, at, _, status) in self.calls.lock().unwrap().iter() {
            if *status == 200 {
                done.entry(record.clone()).or_insert(*at);
            }
        }
        done
    }

    fn throttled(&self) -> usize {
        self.calls.lock().unwrap().iter().filter(|c| c.3 == 429).count()
    }
}

/// Issue 25, end to end against Azurite in both modes: a bulk import of records in the low
/// lane, run by URL logic whose downstream answers 429 past 3 calls at once, drains with
/// nothing poisoned and every record run; a person's save sent to the high lane during the
/// drain runs before the bulk has drained (it does not wait behind the import).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bulk_import_in_the_low_lane_drains_through_a_throttled_downstream_with_nothing_poisoned() {
    let (a, b) = tokio::join!(bulk_scenario(false), bulk_scenario(true));
    for line in [a, b] {
        println!("[bulk] {line}");
    }
}

async fn bulk_scenario(handler: bool) -> String {
    const BULK: usize = 40;
    const LIMIT: usize = 3;
    let work = Duration::from_millis(250);
    let env = Env::new();
    let (downstream, base) = Throttled::serve(LIMIT, work, 1).await;
    let app = env
        .start_as(
            handler,
            vec![
                ("LEASEHOLD_LOGIC_URL", format!("{base}/w/run")),
                ("LEASEHOLD_CONCURRENCY", "8".to_string()),
            ],
        )
        .await;
    let low_name = leasehold_runtime::low_queue_name(&env.queue);
    let counts: std::sync::Arc<std::sync::Mutex<Vec<u32>>> = Default::default();
    let hosts = handler.then(|| {
        [
            emulated_host(&env.queue, app.url("/Worker"), counts.clone()),
            emulated_host(&low_name, app.url("/WorkerLow"), counts.clone()),
        ]
    });
    let low = common::queue(&low_name);
    let started = std::time::Instant::now();
    for i in 0..BULK {
        let body = json!({"scope": "account", "recordId": format!("bulk-{i}")}).to_string();
        if handler {
            // The host writes Start's output to the queue; here the test does.
            let m = TriggerMessage::parse("account", &format!("bulk-{i}")).unwrap();
            low.put(&m.encode(), Duration::ZERO).await.unwrap();
        } else {
            let (status, answer) = common::post(
                &app.url("/api/start?priority=low"),
                &body,
                &[("Content-Type", "application/json")],
            )
            .await;
            assert_eq!(
                (status, answer["priority"].as_str()),
                (202, Some("low")),
                "{answer}"
            );
        }
    }
    // A person saves a record during the drain.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let saved = std::time::Instant::now();
    if handler {
        let m = TriggerMessage::parse("account", "person").unwrap();
        common::queue(&env.queue)
            .put(&m.encode(), Duration::ZERO)
            .await
            .unwrap();
    } else {
        let (status, answer) = common::post(
            &app.url("/api/start"),
            &json!({"scope": "account", "recordId": "person"}).to_string(),
            &[("Content-Type", "application/json")],
        )
        .await;
        assert_eq!(
            (status, answer["priority"].as_str()),
            (202, Some("high")),
            "{answer}"
        );
    }
    let mode = if handler { "handler" } else { "serve" };
    eventually(
        Duration::from_secs(120),
        "every record to run through the throttled downstream",
        || async { (downstream.done().len() == BULK + 1).then_some(()) },
    )
    .await;
    let done = downstream.done();
    let person = done["person"];
    let last_bulk = done
        .iter()
        .filter(|(r, _)| r.starts_with("bulk-"))
        .map(|(_, t)| *t)
        .max()
        .unwrap();
    assert!(
        person < last_bulk,
        "{mode}: the person's save ran {:?} after it was sent, after the whole bulk had drained",
        person - saved
    );
    for queue in [poison_queue_name(&env.queue), poison_queue_name(&low_name)] {
        assert_eq!(
            common::queue(&queue).approximate_len().await.unwrap(),
            0,
            "{mode}: nothing is poisoned ({queue})"
        );
    }
    if let Some(hosts) = hosts {
        for h in hosts {
            h.abort();
        }
    }
    app.stop().await;
    let drain = last_bulk - started;
    let allowed = LIMIT as f64 / work.as_secs_f64();
    format!(
        "{mode}: {BULK} low-lane records drained in {:.1} s ({:.1} runs/s, {:.0} % of the {allowed:.0}/s the downstream allows), {} answers 429; the person's save ran {:.2} s after it was sent; nothing poisoned",
        drain.as_secs_f64(),
        BULK as f64 / drain.as_secs_f64(),
        100.0 * BULK as f64 / drain.as_secs_f64() / allowed,
        downstream.throttled(),
        (person - saved).as_secs_f64(),
    )
}

/// Issue 25: a pause one process sets stops run starts in another. Two `serve` processes on one
/// deployment, their logic URLs telling them apart; the first call is answered 429 with a
/// Retry-After of 12 s; from a few seconds after it (the other process reads the pause within
/// its refresh interval of 3 s) until it ends, neither process calls the downstream, though
/// triggers keep coming; after it, both run again, and nothing is poisoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_set_by_one_process_stops_run_starts_in_another() {
    let env = Env::new();
    // The downstream: the first call is answered 429 (Retry-After: 12), every later one 200.
    let throttled_at: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>> = Default::default();
    let first = throttled_at.clone();
    let app = axum::Router::new().route(
        "/{worker}/run",
        axum::routing::post(
            move |path: axum::extract::Path<String>, body: axum::Json<Value>| {
                let first = first.clone();
                async move {
                    {
                        let mut first = first.lock().unwrap();
                        if first.is_none() {
                            *first = Some(std::time::Instant::now());
                            return (
                                axum::http::StatusCode::TOO_MANY_REQUESTS,
                                [(axum::http::header::RETRY_AFTER, "12")],
                            );
                        }
                    }
                    downstream_ok(&path.0, &body.0);
                    (
                        axum::http::StatusCode::OK,
                        [(axum::http::header::RETRY_AFTER, "0")],
                    )
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let a = env
        .start(
            common::standalone(),
            &[("LEASEHOLD_LOGIC_URL", format!("{front}/a/run"))],
        )
        .await;
    let b = env
        .start(
            common::standalone(),
            &[("LEASEHOLD_LOGIC_URL", format!("{front}/b/run"))],
        )
        .await;
    // Triggers for different records, one every 300 ms, to either process's Start, for 16 s.
    let mut i = 0;
    let sent_until = std::time::Instant::now() + Duration::from_secs(16);
    while std::time::Instant::now() < sent_until {
        let url = if i % 2 == 0 {
            a.url("/api/start")
        } else {
            b.url("/api/start")
        };
        let (status, _) = common::post(
            &url,
            &json!({"scope": "account", "recordId": format!("r{i}")}).to_string(),
            &[("Content-Type", "application/json")],
        )
        .await;
        assert_eq!(status, 202);
        i += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eventually(Duration::from_secs(60), "every record to run", || async {
        (OK_CALLS.lock().unwrap().len() >= i).then_some(())
    })
    .await;
    let throttled_at = throttled_at
        .lock()
        .unwrap()
        .expect("the first call was throttled");
    let calls = OK_CALLS.lock().unwrap().clone();
    let during: Vec<_> = calls
        .iter()
        .filter(|(_, _, at)| {
            *at > throttled_at + Duration::from_secs(5) && *at < throttled_at + Duration::from_secs(11)
        })
        .collect();
    assert!(during.is_empty(), "calls while the pause held: {during:?}");
    let by = |w: &str| calls.iter().filter(|(worker, _, _)| worker == w).count();
    assert!(
        by("a") > 0 && by("b") > 0,
        "both processes ran records: a {} b {}",
        by("a"),
        by("b")
    );
    assert_eq!(
        common::queue(&poison_queue_name(&env.queue))
            .approximate_len()
            .await
            .unwrap(),
        0
    );
    a.stop().await;
    b.stop().await;
}

/// The successful calls of [`a_pause_set_by_one_process_stops_run_starts_in_another`]: worker,
/// record, when.
static OK_CALLS: std::sync::Mutex<Vec<(String, String, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

fn downstream_ok(worker: &str, body: &Value) {
    OK_CALLS.lock().unwrap().push((
        worker.to_string(),
        body["recordId"].as_str().unwrap_or("").to_string(),
        std::time::Instant::now(),
    ));
}

/// What [`Downstream`] answers a call: `Ok(work)` is a 200 after `work`, `Err(seconds)` a 429
/// with that `Retry-After` at once.
type Answer = Result<Duration, u64>;

/// A call to [`Downstream`]: scope, record, when it came, and the status answered.
type ScopedCall = (String, String, std::time::Instant, u16);

/// A downstream for the budget reproductions: `answer(scope, record)` says what each call gets.
/// It notes every call and, per scope, the calls in flight now and the most at once.
#[derive(Clone, Default)]
struct Downstream {
    calls: std::sync::Arc<std::sync::Mutex<Vec<ScopedCall>>>,
    in_flight: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, (usize, usize)>>>,
    /// Each call answered 200: its scope, when it came, and how many of its scope were then in
    /// flight, itself included.
    starts: std::sync::Arc<std::sync::Mutex<Vec<(String, std::time::Instant, usize)>>>,
}

impl Downstream {
    /// Serves `POST /run` on any free port; returns it and the logic URL.
    async fn serve(answer: impl Fn(&str, &str) -> Answer + Send + Sync + 'static) -> (Self, String) {
        let this = Self::default();
        let state = this.clone();
        let answer = std::sync::Arc::new(answer);
        let app = axum::Router::new().route(
            "/run",
            axum::routing::post(move |body: axum::Json<Value>| {
                let (state, answer) = (state.clone(), answer.clone());
                async move {
                    let scope = body["scope"].as_str().unwrap_or("").to_string();
                    let record = body["recordId"].as_str().unwrap_or("").to_string();
                    let at = std::time::Instant::now();
                    let (status, retry_after) = match answer(&scope, &record) {
                        Err(seconds) => (429, seconds),
                        Ok(work) => {
                            {
                                let mut flight = state.in_flight.lock().unwrap();
                                let entry = flight.entry(scope.clone()).or_default();
                                entry.0 += 1;
                                entry.1 = entry.1.max(entry.0);
                                state.starts.lock().unwrap().push((scope.clone(), at, entry.0));
                            }
                            tokio::time::sleep(work).await;
                            state.in_flight.lock().unwrap().get_mut(&scope).unwrap().0 -= 1;
                            (200, 0)
                        }
                    };
                    state.calls.lock().unwrap().push((scope, record, at, status));
                    (
                        axum::http::StatusCode::from_u16(status).unwrap(),
                        [(axum::http::header::RETRY_AFTER, retry_after.to_string())],
                        "",
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/run", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (this, url)
    }

    /// When `record`'s first call answered `status` ended (a 429 ends as it comes).
    fn first(&self, record: &str, status: u16) -> Option<std::time::Instant> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .find(|(_, r, _, s)| r == record && *s == status)
            .map(|c| c.2)
    }

    fn count(&self, scope: &str, status: u16) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _, _, st)| s == scope && *st == status)
            .count()
    }

    /// The most calls of `scope` that ran at once.
    fn most_at_once(&self, scope: &str) -> usize {
        self.in_flight.lock().unwrap().get(scope).map_or(0, |e| e.1)
    }

    /// The most calls of `scope` that ran at once, counted at calls that came after `after`.
    fn most_at_once_after(&self, scope: &str, after: std::time::Instant) -> usize {
        self.starts
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, at, _)| s == scope && *at > after)
            .map(|c| c.2)
            .max()
            .unwrap_or(0)
    }

    /// When the calls of `scope` answered `status` came, in order.
    fn times(&self, scope: &str, status: u16) -> Vec<std::time::Instant> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _, _, st)| s == scope && *st == status)
            .map(|c| c.2)
            .collect()
    }
}

/// Start's answer to a save of `scope`/`record`.
async fn save(app: &Running, scope: &str, record: &str) {
    let (status, answer) = post(
        &app.url("/api/start"),
        &json!({"scope": scope, "recordId": record}).to_string(),
        &[],
    )
    .await;
    assert_eq!(status, 202, "{answer}");
}

const ADMIN_KEY: &str = "app-test-admin-key-6d1e-90b3c2f4a8e7";

/// Issue 35's reproduction (a): a resumed budget runs at once. The downstream answers a record's
/// call 429 with `Retry-After: 300`: the budget pauses for 5 minutes, and a person's save sent
/// during the pause meets it and is handed back (a pause that long is not waited out).
/// `leasehold budget resume default` — the command line, another process: `serve` learns of it
/// from storage — ends the pause, and the person's save runs within a few seconds, not at the
/// pause's original end; so does a save sent after the resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resumed_budget_runs_at_once() {
    let started = std::time::Instant::now();
    let env = Env::new();
    let (downstream, url) = Downstream::serve(|_, record| {
        if record.starts_with("busy") {
            Err(300)
        } else {
            Ok(Duration::from_millis(100))
        }
    })
    .await;
    let app = env
        .start(
            common::standalone(),
            &[
                ("LEASEHOLD_LOGIC_URL", url),
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY.to_string()),
            ],
        )
        .await;
    let store = leasehold_runtime::AzureBudgets::new(
        &leasehold_test_support::Azurite::shared().account(),
        &env.container,
        leasehold_lock::OpCounters::new(),
    );
    use leasehold_runtime::BudgetStore;
    save(&app, "account", "busy-1").await;
    eventually(
        Duration::from_secs(30),
        "the 5-minute pause to be written",
        || async {
            let read = unless_transient(store.read("default").await, "read the budget")?;
            read.filter(|p| p.left > Duration::from_secs(250)).map(|_| ())
        },
    )
    .await;

    // A person's save meets the pause and is handed back.
    let person = unique_name("person");
    save(&app, "account", &person).await;
    let record = app.url(&format!("/api/admin/records/account/{person}"));
    eventually(
        Duration::from_secs(30),
        "the person's save to be handed back",
        || async {
            let view: Value = common::get(&record, &[("x-leasehold-admin-key", ADMIN_KEY)])
                .await
                .json()
                .await
                .ok()?;
            (view["recentOutcome"]["outcome"] == "paused").then_some(())
        },
    )
    .await;
    assert!(downstream.first(&person, 200).is_none());

    // The operator resumes it from the command line.
    let resumed_at = std::time::Instant::now();
    let (ok, out) = env.output(&["budget", "resume", "default"]).await;
    assert!(
        ok && out.contains("resumed budget default"),
        "{out}\n{}",
        env.log("budget")
    );
    let command_took = resumed_at.elapsed();
    let ran = eventually(
        Duration::from_secs(30),
        "the person's save to run after the resume (not at the pause's original end, 5 minutes on)",
        || async { downstream.first(&person, 200) },
    )
    .await;
    let after = ran - resumed_at;
    // And a save sent now runs at once too.
    let later = unique_name("later");
    let sent = std::time::Instant::now();
    save(&app, "account", &later).await;
    let later_ran = eventually(
        Duration::from_secs(30),
        "a save after the resume to run",
        || async { downstream.first(&later, 200) },
    )
    .await;
    println!(
        "[budgets] resumed from the command line (which took {:.2} s): the handed-back save ran {:.2} s after the command was started, a save sent then {:.2} s after it was sent (test {:.1} s)",
        command_took.as_secs_f64(),
        after.as_secs_f64(),
        (later_ran - sent).as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    // `serve` reads the pause within its refresh interval (3 s) while it holds a trigger handed
    // back for it, makes the trigger visible and polls.
    assert!(
        after < command_took + Duration::from_secs(5),
        "{after:?} after the command was started, which took {command_took:?}"
    );
    app.stop().await;
}

/// Issue 35's reproduction (b): an unrelated scope keeps its concurrency beside a record that
/// always answers 429. `LEASEHOLD_CONCURRENCY=4`, one budget for every scope; a contact whose
/// downstream call answers `429 Retry-After: 1` every time (a lock on that record, say), and
/// saves of accounts, 4 a second, whose runs take a second each, so the contact's chain is
/// refused beside them again and again. Those refusals are one record's: the budget's limit
/// stays 4 (each hop cut it, down to 1) and the accounts run 4 at once after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrelated_scope_keeps_its_concurrency_beside_a_record_that_always_answers_429() {
    let started = std::time::Instant::now();
    let env = Env::new();
    let (downstream, url) = Downstream::serve(|scope, _| {
        if scope == "contact" {
            Err(1)
        } else {
            Ok(Duration::from_secs(1))
        }
    })
    .await;
    let app = env
        .start(
            common::standalone(),
            &[
                ("LEASEHOLD_LOGIC_URL", url),
                ("LEASEHOLD_CONCURRENCY", "4".to_string()),
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY.to_string()),
            ],
        )
        .await;
    save(&app, "contact", "always-refused").await;
    // Past its first refusal (which pauses the budget for a second) and into its chain.
    eventually(
        Duration::from_secs(30),
        "the contact to be refused twice",
        || async { (downstream.count("contact", 429) >= 2).then_some(()) },
    )
    .await;
    let sent = std::time::Instant::now();
    for i in 0..32 {
        save(&app, "account", &format!("acc-{i}")).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eventually(Duration::from_secs(90), "the 32 account saves to run", || async {
        (downstream.count("account", 200) >= 32).then_some(())
    })
    .await;
    let took = sent.elapsed();
    let beside: Vec<_> = downstream
        .times("contact", 429)
        .into_iter()
        .filter(|t| *t > sent)
        .collect();
    let all: Value = common::get(
        &app.url("/api/admin/budgets"),
        &[("x-leasehold-admin-key", ADMIN_KEY)],
    )
    .await
    .json()
    .await
    .unwrap();
    let view = all["budgets"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["name"] == "default"))
        .map(|b| b["here"].clone())
        .unwrap_or_else(|| panic!("no budget `default`: {all}"));
    println!(
        "[budgets] 32 one-second runs, 4 saves a second, beside a record refused for ever: {} at once at most, all done {:.2} s after the first was sent; the contact was refused {} times meanwhile; the budget here: {view} (test {:.1} s)",
        downstream.most_at_once("account"),
        took.as_secs_f64(),
        beside.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        beside.len() >= 2,
        "the contact kept being refused beside them: {beside:?}"
    );
    assert_eq!(view["limit"], 4, "{view}");
    assert!(view["recordRefusals"].as_u64().unwrap() >= 2, "{view}");
    assert_eq!(
        downstream.most_at_once_after("account", beside[1]),
        4,
        "after the contact's second refusal beside them, the accounts ran fewer at once (all done in {took:?})"
    );
    app.stop().await;
}

/// Run history across instances (issue 36): a record run three times by two `serve` processes,
/// the first killed mid-run. Its `started` entry outlives it; the survivor's recovery and a
/// third run follow, and `leasehold history` (another process) reads all of it back, newest
/// first, with both holders' names and rising tokens; `leasehold status` says the record is
/// idle, its last run completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_records_history_names_both_holders_when_one_was_killed_mid_run() {
    let env = Env::new();
    let other = env.sibling("second");
    // The first run hangs until its worker dies; later runs finish at once.
    let logic = env.first_run_hangs();
    let settings = [
        ("LEASEHOLD_LOGIC_COMMAND", logic),
        ("LEASEHOLD_LEASE_SECONDS", "15".to_string()),
        ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY.to_string()),
    ];
    let a = env.spawn(&["serve"], &settings).await;
    let b = other.spawn(&["serve"], &settings).await;
    let history = || async {
        let (ok, out) = env
            .output(&["history", "--scope", "account", RECORD, "--json"])
            .await;
        assert!(ok, "{out}");
        serde_json::from_str::<Vec<Value>>(&out).unwrap()
    };
    let enqueue = || async {
        let (ok, out) = env.output(&["enqueue", "--scope", "account", RECORD]).await;
        assert!(ok, "{out}");
    };
    enqueue().await;
    // Its start is in the history (written within 2 s) before its holder dies.
    let started = eventually(
        Duration::from_secs(30),
        "the first run's start in the history",
        || async { history().await.into_iter().find(|e| e["event"] == "started") },
    )
    .await;
    let dead_instance = started["instance"].as_str().unwrap().to_string();
    let dead_pid: u32 = dead_instance.rsplit(':').next().unwrap().parse().unwrap();
    let (mut dying, survivor, survivor_port) = if a.id() == Some(dead_pid) {
        (a, b, other.port())
    } else {
        (b, a, env.port())
    };
    assert_eq!(
        dying.id(),
        Some(dead_pid),
        "the holder is one of the two: {dead_instance}"
    );
    dying.start_kill().unwrap();
    dying.wait().await.unwrap();
    eventually(Duration::from_secs(45), "the record to run again", || async {
        (env.runs().len() >= 2 && history().await.iter().any(|e| e["event"] == "completed")).then_some(())
    })
    .await;
    // A third run, on the survivor.
    enqueue().await;
    let entries = eventually(
        Duration::from_secs(30),
        "the third run in the history",
        || async {
            let entries = history().await;
            // Both runs' ends, and all three starts (written in batches of their own, which
            // need not land in order).
            let count = |event: &str| entries.iter().filter(|e| e["event"] == event).count();
            (count("completed") >= 2 && count("started") >= 3).then_some(entries)
        },
    )
    .await;
    println!("[history] {}", serde_json::to_string_pretty(&entries).unwrap());
    let tokens: Vec<u64> = entries
        .iter()
        .filter(|e| e["event"] == "started")
        .map(|e| e["fencingToken"].as_u64().unwrap())
        .collect();
    assert_eq!(tokens, [3, 2, 1], "three runs, newest first: {entries:#?}");
    let instances: std::collections::BTreeSet<&str> = entries
        .iter()
        .filter(|e| e["event"] == "started")
        .filter_map(|e| e["instance"].as_str())
        .collect();
    assert_eq!(instances.len(), 2, "both holders named: {instances:?}");
    assert_eq!(
        entries.iter().filter(|e| e["event"] == "enqueued").count(),
        2,
        "the operator's enqueues too: {entries:#?}"
    );
    assert!(instances.contains(dead_instance.as_str()));
    // Each run carries its trigger's trace: `leasehold enqueue` made one per trigger, and the
    // dead holder's run and the one that stood in for it share the first.
    let traces: Vec<&str> = entries
        .iter()
        .filter(|e| e["event"] == "started")
        .map(|e| e["traceId"].as_str().expect("a run's trace id"))
        .collect();
    assert_eq!(
        traces[1], traces[2],
        "the recovery run keeps the first trigger's trace"
    );
    assert_ne!(traces[0], traces[1], "the third trigger is a trace of its own");
    for e in &entries {
        for field in ["time", "event", "attempt", "instance"] {
            assert!(!e[field].is_null(), "{field}: {e}");
        }
    }
    let (ok, status) = env
        .output(&["status", "--scope", "account", RECORD, "--json"])
        .await;
    assert!(ok, "{status}");
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["state"], "idle", "{status}");
    assert!(
        status["reason"].as_str().unwrap().contains("completed"),
        "{status}"
    );
    // The dashboard's record view, from the survivor: the same state, and the history.
    let view: Value = common::get(
        &format!("http://127.0.0.1:{survivor_port}/api/admin/records/account/{RECORD}"),
        &[("x-leasehold-admin-key", ADMIN_KEY)],
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(view["state"], "idle", "{view}");
    assert_eq!(
        view["history"].as_array().map(Vec::len),
        Some(entries.len()),
        "{view}"
    );
    drop(dying);
    terminate(&survivor);
    let mut survivor = survivor;
    survivor.wait().await.unwrap();
}

/// One span as the stand-in collector received it.
#[derive(Debug, Clone)]
struct ReceivedSpan {
    name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent: String,
    /// The (trace id, span id) of each link.
    links: Vec<(String, String)>,
    attributes: std::collections::BTreeMap<String, String>,
    service: String,
}

/// A stand-in OTLP/HTTP collector: `POST /v1/traces` with an `ExportTraceServiceRequest` in
/// protobuf, as the OpenTelemetry Collector takes it.
#[derive(Clone, Default)]
struct Collector {
    spans: std::sync::Arc<std::sync::Mutex<Vec<ReceivedSpan>>>,
}

impl Collector {
    async fn serve() -> (Self, String) {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
        use prost::Message;
        let this = Self::default();
        let state = this.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let state = state.clone();
                async move {
                    assert_eq!(headers["content-type"], "application/x-protobuf");
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
                    let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v
                        .as_ref()
                        .and_then(|v| v.value.clone())
                    {
                        Some(Any::StringValue(s)) => s,
                        Some(Any::IntValue(i)) => i.to_string(),
                        Some(Any::BoolValue(b)) => b.to_string(),
                        other => format!("{other:?}"),
                    };
                    for resource in request.resource_spans {
                        let service = resource
                            .resource
                            .iter()
                            .flat_map(|r| r.attributes.iter())
                            .find(|a| a.key == "service.name")
                            .map(|a| text(&a.value))
                            .unwrap_or_default();
                        for scope in resource.scope_spans {
                            for span in scope.spans {
                                state.spans.lock().unwrap().push(ReceivedSpan {
                                    name: span.name,
                                    kind: span.kind,
                                    trace_id: hex(&span.trace_id),
                                    span_id: hex(&span.span_id),
                                    parent: hex(&span.parent_span_id),
                                    links: span
                                        .links
                                        .iter()
                                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                                        .collect(),
                                    attributes: span
                                        .attributes
                                        .iter()
                                        .map(|a| (a.key.clone(), text(&a.value)))
                                        .collect(),
                                    service: service.clone(),
                                });
                            }
                        }
                    }
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (this, url)
    }

    fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }
}

/// A URL logic that records each call's `traceparent`; the first call answers when the test
/// releases it (the `Notify`), the others at once.
async fn traced_downstream() -> (
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    String,
    std::sync::Arc<tokio::sync::Notify>,
) {
    let seen: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let (state, first) = (seen.clone(), release.clone());
    let app = axum::Router::new().route(
        "/run",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let (state, first) = (state.clone(), first.clone());
            async move {
                let traceparent = headers
                    .get("traceparent")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                let n = {
                    let mut seen = state.lock().unwrap();
                    seen.push(traceparent);
                    seen.len()
                };
                if n == 1 {
                    // Bounded, so a failing test still ends.
                    let _ = tokio::time::timeout(Duration::from_secs(60), first.notified()).await;
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/run", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (seen, url, release)
}

/// Issue "What happened to record X": a stand-in OTLP collector receives one trace per
/// trigger; the run is linked to every trigger it covered (the two that coalesced onto the
/// first run are linked from the follow-up run); the URL logic's requests carry their run's
/// context; Start answers with the trace id and keeps the caller's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_per_trigger_reaches_a_collector_with_each_run_linked_to_the_triggers_it_covered() {
    let env = Env::new();
    let (collector, endpoint) = Collector::serve().await;
    let (seen, logic_url, release) = traced_downstream().await;
    let settings = [
        ("LEASEHOLD_LOGIC_URL", logic_url),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_SERVICE_NAME", "leasehold-under-test".to_string()),
        // Export every 200 ms, so the test need not wait for the 5 s default.
        ("OTEL_BSP_SCHEDULE_DELAY", "200".to_string()),
    ];
    let mut server = env.spawn(&["serve"], &settings).await;
    let start = format!("http://127.0.0.1:{}/api/start", env.port());
    let body = json!({ "scope": "account", "recordId": RECORD }).to_string();
    let caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let (status, first) = common::post(
        &start,
        &body,
        &[("content-type", "application/json"), ("traceparent", caller)],
    )
    .await;
    assert_eq!(status, 202, "{first}");
    assert_eq!(
        first["traceId"], "0af7651916cd43dd8448eb211c80319c",
        "the caller's trace is kept: {first}"
    );
    eventually(Duration::from_secs(30), "the first run to start", || async {
        (seen.lock().unwrap().len() == 1).then_some(())
    })
    .await;
    // Two saves during the run: each a trace of its own (the caller sent none).
    let mut coalesced = Vec::new();
    for _ in 0..2 {
        let (status, answer) = common::post(&start, &body, &[("content-type", "application/json")]).await;
        assert_eq!(status, 202, "{answer}");
        let trace = answer["traceId"].as_str().unwrap().to_string();
        assert_eq!(trace.len(), 32, "{answer}");
        coalesced.push(trace);
    }
    assert_ne!(coalesced[0], coalesced[1]);
    // The first run ends once both saves have coalesced onto it (their deliveries' spans say so).
    eventually(
        Duration::from_secs(30),
        "both saves' deliveries coalesced",
        || async {
            let spans = collector.spans();
            coalesced
                .iter()
                .all(|trace| {
                    spans.iter().any(|s| {
                        &s.trace_id == trace
                            && s.name.starts_with("process ")
                            && s.attributes.get("leasehold.outcome").map(String::as_str) == Some("coalesced")
                    })
                })
                .then_some(())
        },
    )
    .await;
    release.notify_one();
    eventually(Duration::from_secs(30), "the follow-up run", || async {
        (seen.lock().unwrap().len() == 2).then_some(())
    })
    .await;
    let runs = eventually(
        Duration::from_secs(30),
        "both runs' spans at the collector",
        || async {
            let runs: Vec<_> = collector
                .spans()
                .into_iter()
                .filter(|s| s.name == "run account")
                .collect();
            (runs.len() == 2).then_some(runs)
        },
    )
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    server.wait().await.unwrap();
    let spans = collector.spans();
    for s in &spans {
        println!(
            "[span] {} kind={} trace={} span={} parent={} links={:?}",
            s.name, s.kind, s.trace_id, s.span_id, s.parent, s.links
        );
    }
    assert!(spans.iter().all(|s| s.service == "leasehold-under-test"));
    let by_id = |id: &str| spans.iter().find(|s| s.span_id == id).cloned();
    // Start's producer spans: one per trigger, the first under the caller's span.
    let sends: Vec<_> = spans.iter().filter(|s| s.name.starts_with("send ")).collect();
    assert_eq!(sends.len(), 3, "one send span per trigger");
    let first_send = sends
        .iter()
        .find(|s| s.trace_id == "0af7651916cd43dd8448eb211c80319c")
        .expect("the first trigger's send span in the caller's trace");
    assert_eq!(first_send.parent, "b7ad6b7169203331");
    assert_eq!(first_send.kind, 4, "producer");
    assert_eq!(first_send.attributes["messaging.operation.type"], "send");
    for trace in &coalesced {
        let process = spans
            .iter()
            .find(|s| &s.trace_id == trace && s.name.starts_with("process "))
            .unwrap_or_else(|| panic!("trigger {trace}'s delivery span"));
        assert_eq!(process.kind, 5, "consumer");
        assert_eq!(process.attributes["leasehold.outcome"], "coalesced");
        assert_eq!(process.attributes["messaging.operation.type"], "process");
    }
    // The first run: in the first trigger's trace, under its delivery, linked to its trigger.
    let (first_run, follow_up) = if runs[0].links.iter().any(|l| coalesced.contains(&l.0)) {
        (&runs[1], &runs[0])
    } else {
        (&runs[0], &runs[1])
    };
    assert_eq!(first_run.trace_id, "0af7651916cd43dd8448eb211c80319c");
    let delivery = by_id(&first_run.parent).expect("the run's parent span");
    assert!(delivery.name.starts_with("process "), "{delivery:?}");
    assert_eq!(
        delivery.parent, first_send.span_id,
        "the delivery is under Start's span"
    );
    assert!(
        first_run
            .links
            .contains(&(first_send.trace_id.clone(), first_send.span_id.clone())),
        "the first run links to its trigger: {first_run:?}"
    );
    // The follow-up run covers both coalesced triggers and links to each; it keeps the chain
    // (its delivery is under the first run's delivery, through the retrigger).
    for trace in &coalesced {
        assert!(
            follow_up.links.iter().any(|l| &l.0 == trace),
            "the follow-up run links to coalesced trigger {trace}: {follow_up:?}"
        );
    }
    assert_eq!(
        follow_up.trace_id, first_run.trace_id,
        "the retrigger keeps the chain"
    );
    assert_eq!(follow_up.attributes["leasehold.fencing_token"], "2");
    // Each run's lease release is a span of its own under it; each acquire under its delivery.
    for run in [first_run, follow_up] {
        assert!(
            spans
                .iter()
                .any(|s| s.name == "lease release" && s.parent == run.span_id),
            "{run:?}"
        );
        assert!(
            spans
                .iter()
                .any(|s| s.name == "lease acquire" && s.parent == run.parent),
            "{run:?}"
        );
    }
    // The record's history has each save as Start took it, and each delivery, with its trace.
    let history = eventually(
        Duration::from_secs(10),
        "the history of the three saves",
        || async {
            let (ok, out) = env
                .output(&["history", "--scope", "account", RECORD, "--json"])
                .await;
            assert!(ok, "{out}");
            let entries: Vec<Value> = serde_json::from_str(&out).unwrap();
            (entries.iter().filter(|e| e["event"] == "completed").count() == 1).then_some(entries)
        },
    )
    .await;
    let traces_of = |event: &str| -> std::collections::BTreeSet<String> {
        history
            .iter()
            .filter(|e| e["event"] == event)
            .map(|e| e["traceId"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let mut all = std::collections::BTreeSet::from([first_run.trace_id.clone()]);
    all.extend(coalesced.iter().cloned());
    assert_eq!(traces_of("enqueued"), all, "Start's entries: {history:#?}");
    assert!(
        history
            .iter()
            .filter(|e| e["event"] == "enqueued")
            .all(|e| e["reason"].as_str().unwrap().starts_with("by Start")),
        "{history:#?}"
    );
    assert_eq!(
        traces_of("coalesced"),
        coalesced.iter().cloned().collect(),
        "{history:#?}"
    );
    assert_eq!(
        traces_of("started"),
        std::collections::BTreeSet::from([first_run.trace_id.clone()])
    );
    // The URL logic got each run's own context.
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            format!("00-{}-{}-01", first_run.trace_id, first_run.span_id),
            format!("00-{}-{}-01", follow_up.trace_id, follow_up.span_id),
        ]
    );
}

/// Application Insights without a collector: with `OTEL_TRACES_EXPORTER=azuremonitor`, the
/// spans go to the ingestion endpoint of `APPLICATIONINSIGHTS_CONNECTION_STRING` (here a
/// stand-in taking `POST /v2/track`, gzip'd JSON envelopes, as the service does): the trigger's
/// delivery is a request whose operation id is the trace id Start answered with, and the run a
/// dependency under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_reach_application_insights_straight_from_its_connection_string() {
    let env = Env::new();
    let envelopes: std::sync::Arc<std::sync::Mutex<Vec<Value>>> = Default::default();
    let state = envelopes.clone();
    let ingestion = axum::Router::new().route(
        "/v2/track",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let state = state.clone();
            async move {
                assert_eq!(headers["content-encoding"], "gzip");
                let mut json = Vec::new();
                std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&body[..]), &mut json).unwrap();
                let items: Vec<Value> = serde_json::from_slice(&json).unwrap();
                let n = items.len();
                state.lock().unwrap().extend(items);
                axum::Json(json!({ "itemsReceived": n, "itemsAccepted": n, "errors": [] }))
            }
        }),
    );
    // The exporter speaks https only: a certificate of the test's own, which the process trusts
    // through SSL_CERT_FILE (the platform's way, which its TLS client reads).
    let (endpoint, cert) = https_stand_in(ingestion, &env.dir).await;
    let settings = [
        ("LEASEHOLD_DEMO_SECONDS", "0".to_string()),
        ("OTEL_TRACES_EXPORTER", "azuremonitor".to_string()),
        (
            "APPLICATIONINSIGHTS_CONNECTION_STRING",
            format!("InstrumentationKey=00000000-0000-4000-8000-000000000036;IngestionEndpoint={endpoint}"),
        ),
        ("SSL_CERT_FILE", cert.display().to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200".to_string()),
    ];
    let mut server = env.spawn(&["serve", "--demo"], &settings).await;
    let start = format!("http://127.0.0.1:{}/api/start", env.port());
    let body = json!({ "scope": "account", "recordId": RECORD }).to_string();
    let (status, answer) = common::post(&start, &body, &[("content-type", "application/json")]).await;
    assert_eq!(status, 202, "{answer}");
    let trace = answer["traceId"].as_str().unwrap().to_string();
    let of_trace = |named: &dyn Fn(&str) -> bool| -> Option<Value> {
        envelopes
            .lock()
            .unwrap()
            .iter()
            .find(|e| {
                e["tags"]["ai.operation.id"] == trace.as_str()
                    && e["data"]["baseData"]["name"].as_str().is_some_and(named)
            })
            .cloned()
    };
    let run = eventually(
        Duration::from_secs(30),
        "the run at Application Insights",
        || async { of_trace(&|n| n == "run account") },
    )
    .await;
    // The delivery's span ends after the run's, so it may reach the ingestion in a later batch.
    let process = eventually(
        Duration::from_secs(30),
        "the delivery's span at Application Insights",
        || async { of_trace(&|n| n.starts_with("process ")) },
    )
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    server.wait().await.unwrap();
    println!(
        "[envelopes] {}",
        serde_json::to_string_pretty(&*envelopes.lock().unwrap()).unwrap()
    );
    assert_eq!(
        process["data"]["baseType"], "RequestData",
        "a consumer span is a request: {process}"
    );
    assert_eq!(run["data"]["baseType"], "RemoteDependencyData", "{run}");
    assert_eq!(
        run["tags"]["ai.operation.parentId"], process["data"]["baseData"]["id"],
        "the run is under the delivery"
    );
    assert_eq!(run["iKey"], "00000000-0000-4000-8000-000000000036");
    assert_eq!(
        run["tags"]["ai.cloud.role"], "leasehold",
        "the service name is the role"
    );
}

/// Serves `router` over HTTPS on a free loopback port, with a certificate for 127.0.0.1 made
/// here; returns the base URL and the certificate's PEM file (in `dir`).
async fn https_stand_in(router: axum::Router, dir: &std::path::Path) -> (String, PathBuf) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    let pem = dir.join("stand-in.pem");
    std::fs::write(&pem, cert.pem()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, router) = (acceptor.clone(), router.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper_util::service::TowerToHyperService::new(router);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (url, pem)
}

/// Issue 44: `serve` with a connection string that gives Blob and Queue endpoints but no Table
/// endpoint runs records with history off, and its start-up log says so naming
/// `TableEndpoint`; it never names (nor so writes to) a derived `….table.core.windows.net`. With
/// the Table endpoint given, its log names the endpoint history writes to (no SAS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_table_endpoint_serve_runs_with_history_off_and_says_so() {
    let full = leasehold_test_support::Azurite::shared().connection_string();
    let without: String = full
        .split(';')
        .filter(|part| !part.trim().starts_with("TableEndpoint="))
        .collect::<Vec<_>>()
        .join(";");
    assert!(!without.contains("TableEndpoint"), "{without}");
    let env = Env::new();
    let mut child = env
        .spawn(
            &["serve"],
            &[
                ("AzureWebJobsStorage", without),
                ("LEASEHOLD_LOGIC_COMMAND", env.logic("exit 0")),
            ],
        )
        .await;
    let (ok, out) = env.output(&["enqueue", "--scope", "account", RECORD]).await;
    assert!(ok, "{out}");
    eventually(Duration::from_secs(30), "the record's run", || async {
        (!env.runs().is_empty()).then_some(())
    })
    .await;
    terminate(&child);
    child.wait().await.unwrap();
    let log = env.log("serve");
    assert!(
        log.contains("run history is off") && log.contains("TableEndpoint"),
        "{log}"
    );
    assert!(!log.contains("table.core.windows.net"), "{log}");
    assert!(!log.contains("run history on"), "{log}");

    let other = env.sibling("with-table");
    let mut child = other
        .spawn(&["serve"], &[("LEASEHOLD_LOGIC_COMMAND", other.logic("exit 0"))])
        .await;
    let table_endpoint = leasehold_test_support::Azurite::shared().table_uri();
    eventually(Duration::from_secs(10), "the history line", || async {
        other.log("serve").contains("run history on").then_some(())
    })
    .await;
    terminate(&child);
    child.wait().await.unwrap();
    let log = other.log("serve");
    let line = log.lines().find(|l| l.contains("run history on")).unwrap();
    assert!(line.contains(&table_endpoint), "{line}");
}
