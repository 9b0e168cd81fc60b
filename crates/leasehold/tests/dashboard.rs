//! The operator dashboard against a real Azurite: its JSON API and auth over HTTP, the custom
//! handler's dashboard functions spoken to as the Functions host speaks, and the page itself in
//! a real (headless) Chromium: the key form, held records, a poison entry's reason, the record
//! detail, a requeue that makes the record run, a paused downstream budget resumed, and a poison
//! queue deeper than a peek shown whole and requeued all at once.
//!
//! The browser test needs Chromium (`scripts/install-chromium.sh`, run by `scripts/test.sh`);
//! without it the test fails with that command, it does not skip.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Env, Running, get};
use leasehold_runtime::{
    Error, LogicError, MarkerStore, PoisonMessage, TriggerMessage, TriggerQueue, low_queue_name,
    poison_queue_name,
};
use leasehold_test_support::browser::Browser;
use leasehold_test_support::{eventually, workspace_root};
use serde_json::{Value, json};

const ADMIN_KEY: &str = "dashboard-test-admin-key-3b9f-5e0a1724";
const START_KEY: &str = "dashboard-test-start-key-81c2-0d9e4b33";

/// The deployment's folder holds the logic's run log.
impl Env {
    fn runs_file(&self) -> PathBuf {
        self.dir.join("runs.log")
    }

    fn release_file(&self) -> PathBuf {
        self.dir.join("release")
    }

    /// Logs each run's record id; records named `held-*` then run until the release file exists,
    /// and records named `throttle-*` say their downstream is busy for 5 minutes (exit 75 with
    /// `Retry-After: 300`: their budget pauses).
    fn logic(&self) -> String {
        format!(
            "echo \"$LEASEHOLD_RECORD_ID\" >> {runs}; case \"$LEASEHOLD_RECORD_ID\" in held-*) \
             while [ ! -f {release} ]; do sleep 0.1; done;; \
             throttle-*) echo 'Retry-After: 300' >&2; exit 75;; esac",
            runs = self.runs_file().display(),
            release = self.release_file().display()
        )
    }

    fn runs(&self) -> Vec<String> {
        std::fs::read_to_string(self.runs_file())
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn vars(&self, extra: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
        let mut vars = common::serve_vars(&self.queue, &self.container);
        vars.push(("LEASEHOLD_LOGIC_COMMAND".into(), self.logic()));
        common::with(vars, extra)
    }

    async fn start(&self, mode: leasehold::Mode, extra: &[(&str, &str)]) -> Running {
        Running::start(leasehold::Settings::from_vars(self.vars(extra)).unwrap(), mode).await
    }

    /// Puts a trigger for `record` on the trigger queue.
    async fn trigger(&self, record: &str) {
        self.trigger_in("account", record).await
    }

    /// Puts a trigger for `record` of `scope` on the trigger queue.
    async fn trigger_in(&self, scope: &str, record: &str) {
        let message = TriggerMessage::parse(scope, record).unwrap();
        common::queue(&self.queue)
            .put(&message.encode(), Duration::ZERO)
            .await
            .unwrap();
    }

    /// Puts a poison entry for `record` with `reason` on the poison queue, as the runner would.
    async fn poison(&self, record: &str, reason: &str) {
        self.poison_in(&self.queue, record, reason).await
    }

    /// The same, on the low lane's poison queue.
    async fn poison_low(&self, record: &str, reason: &str) {
        self.poison_in(&low_queue_name(&self.queue), record, reason).await
    }

    async fn poison_in(&self, queue: &str, record: &str, reason: &str) {
        let trigger = TriggerMessage::parse("account", record).unwrap();
        let entry = PoisonMessage::new(
            trigger.encode(),
            Some(trigger),
            &Error::Logic(LogicError::new(reason)),
            5,
        );
        common::queue(&poison_queue_name(queue))
            .put(&entry.encode(), Duration::ZERO)
            .await
            .unwrap();
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Lets held runs end (the app's shutdown would stop them anyway).
        let _ = std::fs::write(self.release_file(), "");
    }
}

/// [`common::post`] of a JSON body.
async fn post(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let json = [("content-type", "application/json")];
    common::post(url, body, &[&json[..], headers].concat()).await
}

const KEY: (&str, &str) = ("x-leasehold-admin-key", ADMIN_KEY);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_key_there_is_no_dashboard_and_the_key_must_differ_from_starts() {
    let env = Env::new();
    let app = env.start(common::standalone(), &[]).await;
    for path in ["/admin", "/api/admin/overview", "/api/admin/poison"] {
        let response = get(&app.url(path), &[KEY]).await;
        assert_eq!(
            response.status(),
            404,
            "{path} exists without LEASEHOLD_ADMIN_KEY"
        );
    }
    app.stop().await;

    let same = leasehold::Settings::from_vars(env.vars(&[
        ("LEASEHOLD_API_KEY", START_KEY),
        ("LEASEHOLD_ADMIN_KEY", START_KEY),
    ]))
    .unwrap_err();
    let text = format!("{same:#}");
    assert!(
        text.contains("LEASEHOLD_ADMIN_KEY") && text.contains("LEASEHOLD_API_KEY"),
        "{text}"
    );
    assert!(!text.contains(START_KEY), "the key is never in an error: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_its_key_in_its_header_and_says_what_it_did() {
    let env = Env::new();
    env.poison("api-poisoned", "the logic exited with status 3").await;
    env.poison_low("bulk-poisoned", "the logic exited with status 4")
        .await;
    let app = env
        .start(
            common::standalone(),
            &[
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY),
                ("LEASEHOLD_API_KEY", START_KEY),
            ],
        )
        .await;
    let overview = app.url("/api/admin/overview");

    // No key, the wrong key, the Start key, the key in the query string or a cookie: 401
    // naming the header.
    for (headers, url) in [
        (vec![], overview.clone()),
        (vec![("x-leasehold-admin-key", "wrong")], overview.clone()),
        (vec![("x-leasehold-admin-key", START_KEY)], overview.clone()),
        (vec![("x-functions-key", ADMIN_KEY)], overview.clone()),
        (
            vec![],
            format!("{overview}?x-leasehold-admin-key={ADMIN_KEY}&code={ADMIN_KEY}"),
        ),
        (
            vec![("cookie", &*format!("x-leasehold-admin-key={ADMIN_KEY}"))],
            overview.clone(),
        ),
    ] {
        let response = get(&url, &headers).await;
        assert_eq!(response.status(), 401, "{headers:?} {url}");
        let body: Value = response.json().await.unwrap();
        let error = body["error"].as_str().unwrap();
        assert!(error.contains("x-leasehold-admin-key"), "{error}");
        assert!(!error.contains(ADMIN_KEY), "{error}");
    }
    let (status, body) = post(
        &app.url("/api/admin/poison/purge"),
        r#"{"all":true,"confirm":true}"#,
        &[],
    )
    .await;
    assert_eq!(status, 401, "a mutation without the key: {body}");

    // With the key.
    let response = get(&overview, &[KEY]).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["cache-control"], "no-store");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["queue"]["name"], env.queue.as_str());
    assert_eq!(body["poison"]["name"], poison_queue_name(&env.queue));
    assert!(body["held"].is_array(), "{body}");

    let list: Value = get(&app.url("/api/admin/poison"), &[KEY])
        .await
        .json()
        .await
        .unwrap();
    let entries = list["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{list}");
    assert_eq!(entries[0]["recordId"], "api-poisoned");
    assert!(
        entries[0]["reason"].as_str().unwrap().contains("status 3"),
        "{list}"
    );
    let id = entries[0]["id"].as_str().unwrap();
    let one = get(&app.url(&format!("/api/admin/poison/{id}")), &[KEY]).await;
    assert_eq!(one.status(), 200);

    // The low lane's poison queue is its own: `?lane=low`, for every poison operation.
    let low: Value = get(&app.url("/api/admin/poison?lane=low"), &[KEY])
        .await
        .json()
        .await
        .unwrap();
    let low_entries = low["entries"].as_array().unwrap();
    assert_eq!(low_entries.len(), 1, "{low}");
    assert_eq!(low_entries[0]["recordId"], "bulk-poisoned");
    let low_id = low_entries[0]["id"].as_str().unwrap();
    assert_eq!(
        get(&app.url(&format!("/api/admin/poison/{low_id}")), &[KEY])
            .await
            .status(),
        404,
        "not in the high lane's"
    );
    let (status, report) = post(
        &app.url("/api/admin/poison/purge?lane=low"),
        &json!({ "ids": [low_id], "confirm": true }).to_string(),
        &[KEY],
    )
    .await;
    assert_eq!((status, &report["purged"]), (200, &json!([low_id])), "{report}");
    let bad_lane = get(&app.url("/api/admin/poison?lane=medium"), &[KEY]).await;
    assert_eq!(bad_lane.status(), 400);
    let error: Value = bad_lane.json().await.unwrap();
    assert!(error["error"].as_str().unwrap().contains("lane"), "{error}");

    // Wrong requests say what is wrong.
    for (path, body, status, names) in [
        (
            "/api/admin/poison/purge",
            r#"{"ids":["x"]}"#.to_string(),
            400,
            "\"confirm\": true",
        ),
        ("/api/admin/poison/purge", "not json".into(), 400, "not JSON"),
        ("/api/admin/poison/requeue", String::new(), 400, "JSON body"),
        (
            "/api/admin/poison/requeue",
            format!(r#"{{"ids":["{}"]}}"#, "x".repeat(17 * 1024)),
            413,
            "16384",
        ),
        ("/api/admin/nothing", "{}".into(), 404, "no such operation"),
        ("/api/admin/overview", "{}".into(), 405, "GET"),
        // A misspelt field would otherwise widen the purge to the whole scope.
        (
            "/api/admin/poison/purge",
            r#"{"scope":"account","recordID":"x","confirm":true}"#.into(),
            400,
            "recordID",
        ),
    ] {
        let (got, answer) = post(&app.url(path), &body, &[KEY]).await;
        assert_eq!(got, status, "{path}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(names), "{path}: {error}");
    }
    // A GET of a mutation is refused as such (not read as an entry id to scan for).
    for path in ["/api/admin/poison/requeue", "/api/admin/poison/purge"] {
        assert_eq!(get(&app.url(path), &[KEY]).await.status(), 405, "{path}");
    }
    let bad_scope = get(&app.url("/api/admin/records/Not%20A%20Scope!/x"), &[KEY]).await;
    assert_eq!(bad_scope.status(), 400);
    // The entry is still there: none of the refused purges touched it.
    let list: Value = get(&app.url("/api/admin/poison"), &[KEY])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(list["entries"].as_array().unwrap().len(), 1, "{list}");

    // A purge with confirmation says what it purged.
    let (status, report) = post(
        &app.url("/api/admin/poison/purge"),
        &json!({ "ids": [id], "confirm": true }).to_string(),
        &[KEY],
    )
    .await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["purged"], json!([id]), "{report}");
    assert!(report["message"].is_string(), "{report}");
    let list: Value = get(&app.url("/api/admin/poison"), &[KEY])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(list["entries"].as_array().unwrap().len(), 0, "{list}");

    // The page: no data in it, and the headers that keep it to itself.
    let page = get(&app.url("/admin"), &[]).await;
    assert_eq!(page.status(), 200);
    let headers = page.headers().clone();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.starts_with("default-src 'none'")
            && csp.contains("connect-src 'self'")
            && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert_eq!(headers["cache-control"], "no-store");
    assert_eq!(headers["referrer-policy"], "no-referrer");
    let html = page.text().await.unwrap();
    assert!(html.contains(r#"<meta name="leasehold-key-header" content="x-leasehold-admin-key">"#));
    assert!(!html.contains(&env.queue), "the page holds no data");
    app.stop().await;
}

/// The budgets of [`GET /api/admin/budgets`](leasehold::admin), by name.
async fn budgets(app: &Running) -> Vec<Value> {
    let response = get(&app.url("/api/admin/budgets"), &[KEY]).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["budgets"].as_array().unwrap().clone()
}

fn budget<'a>(budgets: &'a [Value], name: &str) -> Option<&'a Value> {
    budgets.iter().find(|b| b["name"] == name)
}

/// The budgets API over a real throttle: a run whose downstream says "busy for 5 minutes"
/// pauses the budget `default`, which `GET budgets` lists with its pause as storage holds it and
/// this process's live view; `POST budgets/default/resume` ends it (in storage and here at once:
/// a trigger sent next runs), a second resume says it was not paused, a bad name is 400 and a
/// budget never paused 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_lists_budgets_with_their_pause_and_resumes_them() {
    let started = Instant::now();
    let env = Env::new();
    let app = env
        .start(common::standalone(), &[("LEASEHOLD_ADMIN_KEY", ADMIN_KEY)])
        .await;
    // Before any throttle: the process's budget, never written, with its live view.
    let all = budgets(&app).await;
    let fresh = budget(&all, "default").unwrap();
    assert_eq!(
        (&fresh["paused"], &fresh["written"], &fresh["here"]["throttles"]),
        (&json!(false), &json!(false), &json!(0)),
        "{fresh}"
    );
    let (status, answer) = post(&app.url("/api/admin/budgets/default/resume"), "{}", &[KEY]).await;
    assert_eq!(status, 404, "never paused: {answer}");

    env.trigger("throttle-0001").await;
    let paused = eventually(Duration::from_secs(30), "the budget to be paused", || async {
        let all = budgets(&app).await;
        budget(&all, "default")
            .filter(|b| b["paused"] == true && b["here"]["throttles"] == 1)
            .cloned()
    })
    .await;
    println!("[budgets] paused: {paused}");
    let left = paused["pausedForSeconds"].as_u64().unwrap();
    assert!((250..=300).contains(&left), "{paused}");
    assert!(
        paused["until"].is_string() && paused["setAt"].is_string(),
        "{paused}"
    );
    assert_eq!(paused["written"], true, "{paused}");
    assert_eq!(paused["resumed"], false, "{paused}");
    let here = &paused["here"];
    let here_left = here["pausedHereForSeconds"].as_u64().unwrap();
    assert!((250..=300).contains(&here_left), "{paused}");
    for field in ["limit", "inFlight", "waitingHigh", "waitingLow", "recordRefusals"] {
        assert!(here[field].is_u64(), "{field}: {paused}");
    }
    // Alone in flight, the refusal paused the budget but did not cut it.
    assert_eq!(here["limit"], 8, "{paused}");

    // Refusals that say what is wrong.
    for (method, path, status, names) in [
        ("POST", "budgets/Not%20A%20Name!/resume", 400, "budget"),
        (
            "POST",
            &*format!("budgets/{}/resume", "x".repeat(64)),
            400,
            "budget",
        ),
        ("POST", "budgets/never-paused/resume", 404, "never-paused"),
        ("GET", "budgets/default/resume", 405, "POST"),
        ("POST", "budgets", 405, "GET"),
    ] {
        let url = app.url(&format!("/api/admin/{path}"));
        let (got, answer) = if method == "POST" {
            post(&url, "{}", &[KEY]).await
        } else {
            let response = get(&url, &[KEY]).await;
            (response.status().as_u16(), response.json().await.unwrap())
        };
        assert_eq!(got, status, "{method} {path}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(names), "{method} {path}: {error}");
    }
    let (status, _) = post(&app.url("/api/admin/budgets/default/resume"), "{}", &[]).await;
    assert_eq!(status, 401, "a resume without the key");
    assert_eq!(
        budget(&budgets(&app).await, "default").unwrap()["paused"],
        true,
        "no refused request ended the pause"
    );

    // Resume: ended in storage and here at once.
    let (status, answer) = post(&app.url("/api/admin/budgets/default/resume"), "{}", &[KEY]).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        (&answer["name"], &answer["wasPaused"]),
        (&json!("default"), &json!(true)),
        "{answer}"
    );
    assert!(
        answer["message"].as_str().unwrap().contains("resumed"),
        "{answer}"
    );
    let all = budgets(&app).await;
    let resumed = budget(&all, "default").unwrap();
    assert_eq!(
        (
            &resumed["paused"],
            &resumed["resumed"],
            &resumed["here"]["pausedHereForSeconds"]
        ),
        (&json!(false), &json!(true), &json!(0)),
        "{resumed}"
    );
    // A trigger sent now runs (not handed back for the rest of the pause).
    let sent = Instant::now();
    env.trigger("after-resume-0001").await;
    eventually(
        Duration::from_secs(15),
        "a trigger after the resume to run",
        || async { env.runs().iter().any(|r| r == "after-resume-0001").then_some(()) },
    )
    .await;
    println!(
        "[budgets] a trigger after the resume ran {:?} after it was sent",
        sent.elapsed()
    );

    // Again: nothing to end.
    let (status, answer) = post(&app.url("/api/admin/budgets/DEFAULT/resume"), "{}", &[KEY]).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["wasPaused"], false, "{answer}");
    assert!(
        answer["message"].as_str().unwrap().contains("not paused"),
        "{answer}"
    );
    app.stop().await;
    println!("[budgets] api test took {:?}", started.elapsed());
}

/// An HTTP-trigger invocation as the Functions host sends it, the caller's admin key forwarded.
fn invocation(method: &str, url: &str, path: Option<&str>, body: Option<&str>) -> String {
    invocation_with_key(method, url, path, body, ADMIN_KEY)
}

fn invocation_with_key(method: &str, url: &str, path: Option<&str>, body: Option<&str>, key: &str) -> String {
    let mut req = json!({
        "Url": url,
        "Method": method,
        "Query": {},
        "Headers": { "x-leasehold-admin-key": [key], "Content-Type": ["application/json"] },
        "Params": {},
        "Identities": [],
    });
    if let Some(path) = path {
        req["Params"] = json!({ "path": path });
    }
    if let Some(body) = body {
        req["Body"] = Value::String(body.to_string());
    }
    json!({ "Data": { "req": req }, "Metadata": {} }).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_custom_handler_serves_the_dashboard_functions() {
    let env = Env::new();
    env.poison("hosted-poisoned", "gave up").await;
    // Any free port (the application says which): none found free and released to race for.
    let app = env
        .start(
            leasehold::Mode::Handler,
            &[
                ("FUNCTIONS_CUSTOMHANDLER_PORT", "0"),
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY),
            ],
        )
        .await;
    assert_ne!(app.port, 0);
    let base = "https://app.azurewebsites.net/api";

    // A web page in a developer's browser (under `func start`) is refused before anything runs:
    // it sends Origin (a `no-cors` POST too), or a rebound DNS name as Host.
    for headers in [
        vec![("origin", "https://evil.example")],
        vec![("host", "rebound.evil.example")],
    ] {
        let (status, answer) = post(
            &app.url("/Ops"),
            &invocation("GET", "", Some("overview"), None),
            &headers,
        )
        .await;
        assert_eq!(status, 403, "{headers:?}: {answer}");
    }

    // The handler checks the key itself: without it, or with another, the caller gets 401 (the
    // invocation itself succeeds) and nothing is done.
    for key in ["", "wrong", START_KEY] {
        let (status, answer) = post(
            &app.url("/Ops"),
            &invocation_with_key(
                "POST",
                "",
                Some("poison/purge"),
                Some(r#"{"all":true,"confirm":true}"#),
                key,
            ),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["Outputs"]["res"]["statusCode"], 401, "{key:?}: {answer}");
        assert_eq!(answer["Logs"], json!([]), "a refusal writes no host log line");
        assert!(
            answer["Outputs"]["res"]["body"]
                .as_str()
                .unwrap()
                .contains("x-leasehold-admin-key")
        );
    }

    let (status, answer) = post(
        &app.url("/Ops"),
        &invocation("GET", &format!("{base}/ops/overview"), Some("overview"), None),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let res = &answer["Outputs"]["res"];
    assert_eq!(res["statusCode"], 200, "{answer}");
    assert_eq!(res["headers"]["Content-Type"], "application/json");
    let overview: Value = serde_json::from_str(res["body"].as_str().unwrap()).unwrap();
    assert_eq!(overview["queue"]["name"], env.queue.as_str());

    // The path from the route parameter when the URL does not carry it; a refusal is the
    // caller's status, not a failed invocation.
    let (status, answer) = post(
        &app.url("/Ops"),
        &invocation("POST", "", Some("poison/purge"), Some(r#"{"all":true}"#)),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["Outputs"]["res"]["statusCode"], 400, "{answer}");
    assert!(
        answer["Outputs"]["res"]["body"]
            .as_str()
            .unwrap()
            .contains("confirm")
    );

    let (_, answer) = post(
        &app.url("/Ops"),
        &invocation("GET", &format!("{base}/ops/poison"), Some("poison"), None),
        &[],
    )
    .await;
    let list: Value = serde_json::from_str(answer["Outputs"]["res"]["body"].as_str().unwrap()).unwrap();
    assert_eq!(list["entries"][0]["recordId"], "hosted-poisoned", "{list}");

    // Budgets: a pause another instance wrote is listed (this handler has no live view of the
    // budget yet), and a resume through the handler ends it.
    let store = leasehold_runtime::AzureBudgets::new(
        &leasehold_test_support::Azurite::shared().account(),
        &env.container,
        leasehold_storage::OpCounters::new(),
    );
    leasehold_runtime::BudgetStore::write(&store, "default", Duration::from_secs(120), 2)
        .await
        .unwrap();
    let ops = |method: &'static str, path: &'static str| {
        let url = format!("{base}/ops/{path}");
        let app = &app;
        async move {
            let (status, answer) = post(
                &app.url("/Ops"),
                &invocation(method, &url, Some(path), Some("{}")),
                &[],
            )
            .await;
            assert_eq!(status, 200, "{answer}");
            let res = &answer["Outputs"]["res"];
            let body: Value = serde_json::from_str(res["body"].as_str().unwrap()).unwrap();
            (res["statusCode"].as_u64().unwrap(), body)
        }
    };
    let (status, listed) = ops("GET", "budgets").await;
    assert_eq!(status, 200, "{listed}");
    let default = &listed["budgets"][0];
    assert_eq!(
        (
            &default["name"],
            &default["paused"],
            &default["limit"],
            &default["here"]
        ),
        (&json!("default"), &json!(true), &json!(2), &Value::Null),
        "{listed}"
    );
    let (status, resumed) = ops("POST", "budgets/default/resume").await;
    assert_eq!((status, &resumed["wasPaused"]), (200, &json!(true)), "{resumed}");
    let (_, listed) = ops("GET", "budgets").await;
    let default = &listed["budgets"][0];
    assert_eq!(
        (
            &default["paused"],
            &default["resumed"],
            &default["here"]["pausedHereForSeconds"]
        ),
        (&json!(false), &json!(true), &json!(0)),
        "{listed}"
    );
    let (status, _) = ops("POST", "budgets/nothing-here/resume").await;
    assert_eq!(status, 404);

    let (status, answer) = post(
        &app.url("/Dashboard"),
        &invocation("GET", &format!("{base}/dashboard"), None, None),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let res = &answer["Outputs"]["res"];
    assert_eq!(res["statusCode"], 200);
    assert!(
        res["headers"]["Content-Security-Policy"]
            .as_str()
            .unwrap()
            .starts_with("default-src 'none'")
    );
    let html = res["body"].as_str().unwrap();
    assert!(html.contains(r#"content="x-leasehold-admin-key""#) && html.contains(r#"content="/api/ops""#));
    assert!(
        !html.contains("master key"),
        "the page never asks for the master key"
    );
    app.stop().await;
}

/// Issue 22, item 5: under Functions the handler served `/Ops` on loopback with no check of its
/// own, and a logic command found the port and purged the poison queue. Now a logic that
/// finds every listening loopback port (`tests/fixtures/ops_spy.py`, from `/proc/net/tcp`) and
/// asks each to purge is refused by the handler, and the entry stays; and with no
/// `LEASEHOLD_ADMIN_KEY` the API is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logic_on_the_handlers_machine_cannot_drive_the_admin_api() {
    let env = Env::new();
    env.poison("stays-poisoned", "gave up").await;
    let report = env.dir.join("ops_spy.out");
    let spy = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ops_spy.py");
    let command = format!("python3 {spy} {}", report.display());
    let app = env
        .start(
            leasehold::Mode::Handler,
            &[
                ("FUNCTIONS_CUSTOMHANDLER_PORT", "0"),
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY),
                ("LEASEHOLD_LOGIC_COMMAND", &command),
            ],
        )
        .await;
    // The host delivers a trigger: the logic runs on the handler's machine.
    let trigger = TriggerMessage::parse("account", "spy").unwrap();
    let worker = json!({
        "Data": { "trigger": trigger.to_json() },
        "Metadata": { "DequeueCount": 1, "Id": "\"spy\"" }
    });
    let (status, answer) = post(&app.url("/Worker"), &worker.to_string(), &[]).await;
    assert_eq!(status, 200, "{answer}");
    let text = std::fs::read_to_string(&report).unwrap();
    println!("[dashboard] the logic's report:\n{text}");
    assert!(
        text.contains(&format!("handler on {}", app.port)),
        "the logic found the handler's port: {text}"
    );
    assert!(
        text.contains(&format!("purge on {}: 401", app.port)),
        "the handler refused the logic's purge: {text}"
    );
    let left = common::queue(&poison_queue_name(&env.queue))
        .peek(32)
        .await
        .unwrap();
    assert_eq!(left.len(), 1, "the poison entry is still there");
    app.stop().await;

    // No LEASEHOLD_ADMIN_KEY: the API is off, whatever key is sent.
    let app = env
        .start(leasehold::Mode::Handler, &[("FUNCTIONS_CUSTOMHANDLER_PORT", "0")])
        .await;
    let (_, answer) = post(
        &app.url("/Ops"),
        &invocation("GET", "", Some("overview"), None),
        &[],
    )
    .await;
    assert_eq!(answer["Outputs"]["res"]["statusCode"], 404, "{answer}");
    assert!(
        answer["Outputs"]["res"]["body"]
            .as_str()
            .unwrap()
            .contains("set LEASEHOLD_ADMIN_KEY")
    );
    app.stop().await;
}

/// Evaluates `expression` in the page; panics with the browser's log on failure.
async fn eval(browser: &Browser, expression: &str) -> Value {
    browser
        .eval(expression)
        .await
        .unwrap_or_else(|e| panic!("{e}\nChromium's log:\n{}", browser.log()))
}

async fn wait(browser: &Browser, expression: &str, what: &str) -> Value {
    browser
        .wait_for(expression, Duration::from_secs(60), what)
        .await
        .unwrap_or_else(|e| panic!("{e}\nChromium's log:\n{}", browser.log()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_page_shows_held_records_and_poison_and_requeues_from_the_browser() {
    let started = Instant::now();
    let browser = match Browser::launch(1280, 800).await {
        Ok(b) => b,
        Err(e) => panic!(
            "the dashboard test needs a real browser: {e}{}",
            if std::env::var_os("CI").is_some() {
                " (CI: scripts/test.sh installs it)"
            } else {
                ""
            }
        ),
    };
    let env = Env::new();
    let poisoned = "8f9c1d2e-0000-4000-8000-00000000a11c";
    // A reason with markup in it (an upstream's HTML error page): the page must show it as text.
    env.poison(
        poisoned,
        "the logic exited with status 3: POST /credit-check answered 502 <title id=injected>Bad Gateway</title>",
    )
    .await;
    // And one in the low lane (bulk traffic): its own poison queue, behind the lane switch.
    let bulk_poisoned = "bulk-import-0917";
    env.poison_low(bulk_poisoned, "the logic exited with status 4: duplicate key")
        .await;
    let app = env
        .start(
            common::standalone(),
            &[
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY),
                ("LEASEHOLD_API_KEY", START_KEY),
                // A run records its holder at its first lease renewal: every 5 s at 15 s.
                ("LEASEHOLD_LEASE_SECONDS", "15"),
            ],
        )
        .await;
    let held = ["held-invoice-2291", "held-contact-0042", "held-account-7f3a"];
    for record in held {
        env.trigger(record).await;
    }
    eventually(Duration::from_secs(30), "the held records to start", || async {
        let runs = env.runs();
        held.iter().all(|r| runs.iter().any(|x| x == r)).then_some(())
    })
    .await;
    // A trigger for a running record: it coalesces, and the record will run once more.
    env.trigger(held[0]).await;

    // The key form, filled in and sent as a person would.
    sign_in(&browser, &app).await;

    // The held records, and the poison entry with its reason (as text: no element injected).
    for record in held {
        wait(
            &browser,
            &format!("!!document.querySelector('#held tbody tr[data-record=\"account/{record}\"]')"),
            &format!("held record {record} in the table"),
        )
        .await;
    }
    let reason = wait(
        &browser,
        "Array.from(document.querySelectorAll('#poison tbody tr')).map(r => r.textContent).join('\\n')",
        "a poison entry",
    )
    .await;
    let reason = reason.as_str().unwrap();
    assert!(
        reason.contains(poisoned) && reason.contains("answered 502 <title id=injected>Bad Gateway</title>"),
        "{reason}"
    );
    assert_eq!(
        eval(&browser, "document.getElementById('injected') === null").await,
        true
    );
    let row = wait(
        &browser,
        "(() => { const c = Array.from(document.querySelectorAll('#held tbody tr[data-record=\"account/held-invoice-2291\"] td')).map(c => c.textContent); return c[2] && c[2].endsWith(' ago') ? c : null; })()",
        "the held record's holder and start, recorded at its first renewal",
    )
    .await;
    let cells: Vec<&str> = row
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(
        cells[2].contains("Z, ") && cells[2].ends_with(" ago"),
        "since as \"12:04:31Z, 3 m 12 s ago\": {cells:?}"
    );
    assert!(cells[3].parse::<u64>().unwrap() >= 1, "generation: {cells:?}");
    assert_eq!(cells[4], "running", "{cells:?}");
    wait(
        &browser,
        &format!(
            "!!document.querySelector('#pending [data-record=\"account/{}\"]') && \
             document.querySelector('#held tbody tr[data-record=\"account/{}\"]').textContent.includes('pending')",
            held[0], held[0]
        ),
        "the coalesced trigger as a pending retrigger",
    )
    .await;
    // A record waiting for its burst of triggers to end (debounce): its wait marker.
    let markers = leasehold_runtime::AzureMarkers::new(
        &leasehold_test_support::Azurite::shared().account(),
        &env.container,
        leasehold_storage::OpCounters::new(),
    );
    markers
        .wait_create(&TriggerMessage::parse("account", "burst-lead-0007").unwrap().key())
        .await
        .unwrap();
    let chip = wait(
        &browser,
        "(document.querySelector('#waiting [data-record=\"account/burst-lead-0007\"]') || {}).textContent",
        "the waiting record",
    )
    .await;
    assert!(
        chip.as_str().unwrap().ends_with(" s"),
        "with the time since a trigger: {chip}"
    );
    let stamp = eval(&browser, "document.getElementById('stamp-text').textContent").await;
    assert!(stamp.as_str().unwrap().starts_with("updated "), "{stamp}");

    // Let a refresh pass so the ages move, then the screenshot docs/operating.md shows (docs/dashboard.png).
    wait(
        &browser,
        &format!("document.getElementById('stamp-text').textContent !== {stamp}"),
        "the live refresh to update the stamp",
    )
    .await;
    let shot = workspace_root().join("target/dashboard/dashboard.png");
    browser.save_screenshot(&shot).await.unwrap();
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "a screenshot with content"
    );

    // The record detail.
    eval(
        &browser,
        "document.querySelector('#held tbody tr[data-record=\"account/held-contact-0042\"]').click(); true",
    )
    .await;
    let detail = wait(
        &browser,
        "(() => { const t = document.getElementById('detail-body').textContent; \
          return !document.getElementById('detail').hidden && t.includes('Generation') && !t.includes('Loading') && t; })()",
        "the record detail",
    )
    .await;
    let detail = detail.as_str().unwrap();
    assert!(
        detail.contains("held") && detail.contains("Holder") && detail.contains("Recent outcome"),
        "{detail}"
    );
    assert_eq!(
        eval(&browser, "document.getElementById('detail-title').textContent").await,
        "held-contact-0042"
    );
    eval(&browser, "document.getElementById('detail-close').click(); true").await;

    // A reload keeps the key for the tab: no form, data again.
    browser.navigate(&app.url("/admin")).await.unwrap();
    wait(
        &browser,
        "document.getElementById('login').hidden && document.querySelectorAll('#poison tbody tr').length === 1",
        "the dashboard again after a reload, without the key form",
    )
    .await;

    // Requeue from the entry's button: the record runs and the entry is gone.
    assert!(!env.runs().iter().any(|r| r == poisoned));
    eval(
        &browser,
        "document.querySelector('#poison tbody tr button.requeue').click(); true",
    )
    .await;
    let said = toasts(&browser, "the requeue's answer").await;
    assert!(said.as_str().unwrap().contains("requeued 1 entry"), "{said}");
    eventually(Duration::from_secs(30), "the requeued record to run", || async {
        env.runs().iter().any(|r| r == poisoned).then_some(())
    })
    .await;
    wait(
        &browser,
        "document.querySelectorAll('#poison tbody tr').length === 0 && !document.getElementById('poison-empty').hidden",
        "the requeued entry to leave the poison table",
    )
    .await;

    // The low lane's poison queue, behind the lane switch (which shows each lane's depth):
    // its entry, requeued into the low lane, runs too.
    let switch = wait(
        &browser,
        "!document.getElementById('poison-lanes').hidden && document.getElementById('lane-low').textContent",
        "the lane switch",
    )
    .await;
    assert!(switch.as_str().unwrap().contains('1'), "{switch}");
    eval(&browser, "document.getElementById('lane-low').click(); true").await;
    let row = wait(
        &browser,
        "Array.from(document.querySelectorAll('#poison tbody tr')).map(r => r.textContent).join('\\n') || false",
        "the low lane's poison entry",
    )
    .await;
    assert!(row.as_str().unwrap().contains(bulk_poisoned), "{row}");
    assert!(!env.runs().iter().any(|r| r == bulk_poisoned));
    eval(
        &browser,
        "document.querySelector('#poison tbody tr button.requeue').click(); true",
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "the low lane's requeued record to run",
        || async { env.runs().iter().any(|r| r == bulk_poisoned).then_some(()) },
    )
    .await;
    wait(
        &browser,
        "document.querySelectorAll('#poison tbody tr').length === 0 && \
         document.getElementById('poison-empty').textContent.includes('low lane')",
        "the low lane's poison table to empty",
    )
    .await;

    // Downstream budgets. The held runs end; then a run whose downstream is busy for 5 minutes
    // pauses the budget `default`: the page shows the pause and a resume button. A cancelled
    // confirmation sends nothing; a confirmed one ends the pause, and a trigger sent then runs.
    std::fs::write(env.release_file(), "").unwrap();
    wait(
        &browser,
        "document.querySelectorAll('#held tbody tr').length === 0",
        "the held runs to end",
    )
    .await;
    env.trigger("throttle-0042").await;
    let row = wait(
        &browser,
        "(() => { const r = document.querySelector('#budgets tbody tr[data-budget=\"default\"][data-paused=\"true\"]'); \
          return r && r.querySelector('button.resume-budget') ? Array.from(r.querySelectorAll('td')).map(c => c.textContent) : null; })()",
        "the paused budget with its resume button",
    )
    .await;
    let cells: Vec<&str> = row
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    println!("[dashboard] the paused budget's row: {cells:?}");
    assert_eq!(cells[0], "default", "{cells:?}");
    assert!(
        cells[1].starts_with("paused")
            && cells[1].contains(" more (until ")
            && cells[1].contains("last written"),
        "{cells:?}"
    );
    assert!(
        cells[4].contains("high 0") && cells[4].contains("low 0"),
        "{cells:?}"
    );
    assert!(cells[5].starts_with('1'), "one throttle: {cells:?}");
    eval(
        &browser,
        "window.resumes = 0; const fetched = window.fetch; \
         window.fetch = (url, init) => { if (String(url).includes('/resume')) window.resumes++; return fetched(url, init); }; \
         window.confirm = () => false; document.querySelector('#budgets button.resume-budget').click(); true",
    )
    .await;
    assert_eq!(
        eval(&browser, "window.resumes").await,
        0,
        "a cancelled resume sent a request"
    );
    eval(
        &browser,
        "window.confirm = (text) => { window.confirmed = text; return true; }; \
         document.querySelector('#budgets button.resume-budget').click(); true",
    )
    .await;
    wait(
        &browser,
        "Array.from(document.querySelectorAll('#toasts .toast')).some(t => t.textContent.includes('resumed budget default'))",
        "the resume's answer",
    )
    .await;
    let asked = eval(&browser, "window.confirmed").await;
    assert!(
        asked.as_str().unwrap().contains("Resume the budget default"),
        "{asked}"
    );
    wait(
        &browser,
        "(() => { const r = document.querySelector('#budgets tbody tr[data-budget=\"default\"]'); \
          return !!r && r.dataset.paused === 'false' && r.textContent.includes('resumed by an operator') && !r.querySelector('button'); })()",
        "the budget running again, resumed",
    )
    .await;
    assert_eq!(eval(&browser, "window.resumes").await, 1);
    env.trigger("after-resume-0042").await;
    eventually(
        Duration::from_secs(15),
        "a trigger after the resume to run",
        || async { env.runs().iter().any(|r| r == "after-resume-0042").then_some(()) },
    )
    .await;

    // Forget the key: the form again, and the tab no longer holds it.
    eval(&browser, "document.getElementById('forget').click(); true").await;
    wait(
        &browser,
        "!document.getElementById('login').hidden",
        "the key form after forgetting",
    )
    .await;
    assert_eq!(eval(&browser, "sessionStorage.length").await, 0);

    assert_eq!(browser.exceptions(), Vec::<String>::new(), "the page threw");
    // The check above sees an uncaught exception when there is one.
    eval(
        &browser,
        "setTimeout(() => { throw new Error('probe'); }, 0); true",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !browser.exceptions().iter().any(|e| e.contains("probe")) {
        assert!(Instant::now() < deadline, "an uncaught exception was not seen");
        eval(&browser, "true").await;
    }
    std::fs::write(env.release_file(), "").unwrap();
    app.stop().await;
    drop(browser);
    eprintln!("dashboard browser test took {:?}", started.elapsed());
}

/// The text of the toasts shown so far, once there is one.
async fn toasts(browser: &Browser, what: &str) -> Value {
    wait(
        browser,
        "Array.from(document.querySelectorAll('#toasts .toast')).map(t => t.textContent).join(' | ')",
        what,
    )
    .await
}

/// Opens the dashboard at `app` and signs in with the admin key, as a person would.
async fn sign_in(browser: &Browser, app: &Running) {
    browser.navigate(&app.url("/admin")).await.unwrap();
    wait(
        browser,
        "!document.getElementById('login').hidden",
        "the key form",
    )
    .await;
    eval(
        browser,
        &format!(
            "document.getElementById('key-input').value = {key:?}; \
             document.getElementById('key-form').requestSubmit(); true",
            key = ADMIN_KEY
        ),
    )
    .await;
    wait(
        browser,
        "document.getElementById('login').hidden",
        "the key accepted",
    )
    .await;
}

/// More poison entries than a peek shows: the page says so, shows them all on request (a scan),
/// and "Requeue all" (confirmed) makes every record run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_deep_poison_queue_whole_and_requeues_all_of_it() {
    let browser = Browser::launch(1280, 800)
        .await
        .unwrap_or_else(|e| panic!("the dashboard test needs a real browser: {e}"));
    let env = Env::new();
    let mut records: Vec<String> = (0..40).map(|i| format!("bulk-{i:02}")).collect();
    for record in &records {
        env.poison(record, "the logic exited with status 1").await;
    }
    let app = env
        .start(common::standalone(), &[("LEASEHOLD_ADMIN_KEY", ADMIN_KEY)])
        .await;
    sign_in(&browser, &app).await;

    // A peek: 32 rows, the count says there are more, and the way to see them is offered.
    wait(
        &browser,
        "document.querySelectorAll('#poison tbody tr').length === 32 && \
         document.getElementById('poison-title-count').textContent === '32+' && \
         !document.getElementById('poison-more').hidden && !document.getElementById('poison-all').hidden",
        "32 of the 40 entries, and a way to see the rest",
    )
    .await;
    eval(&browser, "document.getElementById('poison-all').click(); true").await;
    wait(
        &browser,
        "document.querySelectorAll('#poison tbody tr').length === 40 && \
         document.getElementById('poison-title-count').textContent === '40' && \
         document.getElementById('poison-more').hidden",
        "all 40 entries after \"Show all\"",
    )
    .await;
    let shown = eval(
        &browser,
        "Array.from(document.querySelectorAll('#poison tbody tr')).map(r => r.textContent).join('\\n')",
    )
    .await;
    for record in &records {
        assert!(
            shown.as_str().unwrap().contains(record.as_str()),
            "{record} in {shown}"
        );
    }
    // The scan put every entry back.
    let poison = common::queue(&poison_queue_name(&env.queue));
    assert_eq!(poison.peek(32).await.unwrap().len(), 32);

    // Count the page's scans and requeues from here on.
    eval(
        &browser,
        "window.calls = { scans: 0, requeues: 0 }; const fetched = window.fetch; \
         window.fetch = (url, init) => { const u = String(url); \
           if (u.includes('poison?limit=')) window.calls.scans++; \
           if (u.includes('poison/requeue')) window.calls.requeues++; \
           return fetched(url, init); }; true",
    )
    .await;
    // One more entry: the depth moves, and the page says so rather than scan again on its timer.
    records.push("bulk-40".to_string());
    env.poison("bulk-40", "the logic exited with status 1").await;
    wait(
        &browser,
        "!document.getElementById('poison-changed').hidden",
        "the note that the poison queue changed",
    )
    .await;
    assert_eq!(
        eval(
            &browser,
            "[document.querySelectorAll('#poison tbody tr').length, window.calls.scans]"
        )
        .await,
        json!([40, 0]),
        "no scan on the timer"
    );
    eval(&browser, "document.getElementById('poison-reload').click(); true").await;
    wait(
        &browser,
        "document.querySelectorAll('#poison tbody tr').length === 41 && \
         document.getElementById('poison-changed').hidden && window.calls.scans === 1",
        "all 41 entries, read again on request",
    )
    .await;

    // "Requeue all", cancelled: nothing is sent.
    let sent = eval(
        &browser,
        "window.confirm = () => false; document.getElementById('requeue-all').click(); window.calls.requeues",
    )
    .await;
    assert_eq!(sent, 0, "a cancelled requeue sent a request");

    // "Requeue all", confirmed: one request for the whole queue, and every record runs.
    assert!(env.runs().is_empty());
    eval(
        &browser,
        "window.confirm = (text) => { window.confirmed = text; return true; }; \
         document.getElementById('requeue-all').click(); true",
    )
    .await;
    let said = toasts(&browser, "the requeue's answer").await;
    assert!(said.as_str().unwrap().contains("requeued 41 entries"), "{said}");
    let asked = eval(&browser, "window.confirmed").await;
    assert!(asked.as_str().unwrap().contains("about 41"), "{asked}");
    assert_eq!(eval(&browser, "window.calls.requeues").await, 1);
    eventually(
        Duration::from_secs(60),
        "every requeued record to run",
        || async {
            let runs = env.runs();
            records.iter().all(|r| runs.contains(r)).then_some(())
        },
    )
    .await;
    wait(
        &browser,
        "document.querySelectorAll('#poison tbody tr').length === 0 && \
         !document.getElementById('poison-empty').hidden && document.getElementById('requeue-all').hidden",
        "an empty poison table, and no \"Requeue all\"",
    )
    .await;
    assert_eq!(poison.approximate_len().await.unwrap(), 0);
    assert_eq!(browser.exceptions(), Vec::<String>::new(), "the page threw");
    app.stop().await;
}

/// The record view's history events (newest first), from the API.
async fn history_events(app: &Running, scope: &str, record: &str) -> Vec<String> {
    let view: Value = get(&app.url(&format!("/api/admin/records/{scope}/{record}")), &[KEY])
        .await
        .json()
        .await
        .unwrap();
    view["history"]
        .as_array()
        .unwrap_or_else(|| panic!("no history: {view}"))
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect()
}

/// The run list and "run it again" in the admin API (issue 36): a record enqueued through the
/// API runs, its history says `enqueued`, and the run list shows its run, by scope and outcome;
/// bad parameters are refused with a 400 naming them, wrong methods with a 405.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_lists_recent_runs_and_enqueues_a_record() {
    let env = Env::new();
    let app = env
        .start(common::standalone(), &[("LEASEHOLD_ADMIN_KEY", ADMIN_KEY)])
        .await;
    let (status, answer) = post(
        &app.url("/api/admin/records/account/api-enqueued-0001/enqueue"),
        "{}",
        &[KEY],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["message"]
            .as_str()
            .unwrap()
            .contains("enqueued account/api-enqueued-0001"),
        "{answer}"
    );
    env.trigger_in("contact", "api-other-0002").await;
    let runs = eventually(Duration::from_secs(30), "both runs in the run list", || async {
        let list: Value = get(&app.url("/api/admin/runs?since=15m"), &[KEY])
            .await
            .json()
            .await
            .unwrap();
        (list["runs"].as_array().map_or(0, Vec::len) >= 2).then_some(list)
    })
    .await;
    assert_eq!(runs["partial"], false, "{runs}");
    let run = &runs["runs"][0];
    for field in [
        "scope",
        "recordId",
        "event",
        "time",
        "runSeconds",
        "fencingToken",
        "instance",
    ] {
        assert!(!run[field].is_null(), "{field}: {run}");
    }
    let scoped: Value = get(
        &app.url("/api/admin/runs?scope=account&outcome=completed,failed&since=1h&limit=10"),
        &[KEY],
    )
    .await
    .json()
    .await
    .unwrap();
    let records: Vec<&str> = scoped["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["recordId"].as_str().unwrap())
        .collect();
    assert_eq!(records, ["api-enqueued-0001"], "{scoped}");
    assert_eq!(scoped["outcomes"], json!(["completed", "failed"]), "{scoped}");
    let none: Value = get(&app.url("/api/admin/runs?outcome=poisoned"), &[KEY])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(none["runs"], json!([]), "{none}");
    assert!(
        history_events(&app, "account", "api-enqueued-0001")
            .await
            .contains(&"enqueued".to_string())
    );
    // The same from the command line: `leasehold runs`.
    let cli = |args: &'static [&'static str]| {
        let vars = common::storage_vars(&env.queue, &env.container);
        async move {
            let out = common::leasehold(args)
                .envs(vars)
                .env("RUST_LOG", "warn")
                .output()
                .await
                .unwrap();
            let text =
                String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        }
    };
    let (ok, text) = cli(&["runs", "--scope", "contact", "--since", "15m"]).await;
    assert!(ok, "{text}");
    assert!(
        text.starts_with("contact/api-other-0002  ")
            && text.contains("completed")
            && !text.contains("account/"),
        "{text}"
    );
    let (ok, text) = cli(&["runs", "--outcome", "started"]).await;
    assert!(!ok && text.contains("not an outcome that ends a run"), "{text}");

    // Bad parameters: 400, naming what is wrong.
    for (query, names) in [
        ("since=soon", "window"),
        ("since=0", "window"),
        ("since=30d", "longer than the history is kept"),
        ("outcome=started", "not an outcome that ends a run"),
        ("outcome=exploded", "completed, retriggered"),
        ("limit=0", "limit"),
        ("limit=many", "limit"),
        ("limit=5000", "limit"),
        ("scope=Not%20A%20Scope!", "scope"),
    ] {
        let response = get(&app.url(&format!("/api/admin/runs?{query}")), &[KEY]).await;
        assert_eq!(response.status(), 400, "{query}");
        let body: Value = response.json().await.unwrap();
        let error = body["error"].as_str().unwrap();
        assert!(error.contains(names), "{query}: {error}");
    }
    for (path, names) in [
        ("/api/admin/records/Not%20A%20Scope!/x/enqueue", "scope"),
        ("/api/admin/records/account/not%20an%20id/enqueue", "recordId"),
    ] {
        let (status, answer) = post(&app.url(path), "{}", &[KEY]).await;
        assert_eq!(status, 400, "{path}: {answer}");
        assert!(
            answer["error"].as_str().unwrap().contains(names),
            "{path}: {answer}"
        );
    }
    let (status, answer) = post(&app.url("/api/admin/runs"), "{}", &[KEY]).await;
    assert_eq!(status, 405, "{answer}");
    let response = get(&app.url("/api/admin/records/account/x/enqueue"), &[KEY]).await;
    assert_eq!(response.status(), 405);
    let (status, _) = post(&app.url("/api/admin/records/account/x/enqueue"), "{}", &[]).await;
    assert_eq!(status, 401, "a run asked for without the key");
    app.stop().await;
}

/// The record page and the run list in a real Chromium (issue 36): a record that ran twice, a
/// trigger coalescing onto its first run; its page, opened by a link (#record/<scope>/<id>),
/// shows its state line, two run bars and the coalesced mark on its timeline, its history newest
/// first and its poison entry (its reason as text); "Run it again" writes `enqueued` and makes a
/// third run. The run list shows every scope's runs, and filtered by scope and outcome only the
/// record's completed ones; each row links to the record's page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_page_shows_a_records_runs_and_runs_it_again_and_the_run_list_filters() {
    let started = Instant::now();
    let browser = match Browser::launch(1280, 900).await {
        Ok(b) => b,
        Err(e) => panic!("the dashboard test needs a real browser: {e}"),
    };
    let env = Env::new();
    const RECORD: &str = "held-order-5521";
    let page = format!("#record/account/{RECORD}");
    let app = env
        .start(
            common::standalone(),
            &[
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY),
                ("LEASEHOLD_LEASE_SECONDS", "15"),
            ],
        )
        .await;
    sign_in(&browser, &app).await;
    // Its first run holds until the release file exists; a trigger meanwhile coalesces.
    env.trigger(RECORD).await;
    eventually(Duration::from_secs(30), "the record's first run", || async {
        env.runs().iter().any(|r| r == RECORD).then_some(())
    })
    .await;
    env.trigger(RECORD).await;
    eventually(
        Duration::from_secs(30),
        "the coalesced trigger in the history",
        || async {
            history_events(&app, "account", RECORD)
                .await
                .contains(&"coalesced".to_string())
                .then_some(())
        },
    )
    .await;
    // The held record's row links to its page.
    wait(
        &browser,
        &format!(
            "!!document.querySelector('#held tbody tr[data-record=\"account/{RECORD}\"] a[href=\"{page}\"]')"
        ),
        "the held record's link to its page",
    )
    .await;
    // A poison entry of the record, its reason with markup in it: shown as text.
    env.poison(
        RECORD,
        "the logic exited with status 3: <img id=injected-rec src=x>",
    )
    .await;
    std::fs::write(env.release_file(), "").unwrap();
    // Another scope's run, for the run list.
    env.trigger_in("contact", "contact-0042").await;
    eventually(
        Duration::from_secs(30),
        "both runs ended in the history",
        || async {
            let events = history_events(&app, "account", RECORD).await;
            let other = history_events(&app, "contact", "contact-0042").await;
            (events.iter().filter(|e| *e == "started").count() == 2
                && events.first().map(String::as_str) == Some("completed")
                && other.first().map(String::as_str) == Some("completed"))
            .then_some(())
        },
    )
    .await;

    // The record's page, opened fresh from its link.
    browser.navigate("about:blank").await.unwrap();
    browser
        .navigate(&app.url(&format!("/admin{page}")))
        .await
        .unwrap();
    let line = wait(
        &browser,
        "(() => { const s = document.getElementById('rec-state'); \
          return !document.getElementById('record-view').hidden && s.dataset.state === 'idle' && s.textContent; })()",
        "the record's state line",
    )
    .await;
    let line = line.as_str().unwrap();
    assert!(
        line.starts_with("idle") && line.contains("last: completed"),
        "{line}"
    );
    assert_eq!(
        eval(&browser, "document.getElementById('rec-id').textContent").await,
        RECORD
    );
    let bars = wait(
        &browser,
        "(() => { const b = Array.from(document.querySelectorAll('#rec-timeline rect.bar')).map(b => b.dataset.outcome); \
          return b.length === 2 && b; })()",
        "two run bars",
    )
    .await;
    assert_eq!(bars, json!(["retriggered", "completed"]), "oldest first");
    assert_eq!(
        eval(
            &browser,
            "document.querySelectorAll('#rec-timeline circle.mark[data-event=\"coalesced\"]').length"
        )
        .await,
        1
    );
    let title = eval(
        &browser,
        "document.querySelector('#rec-timeline rect.bar[data-outcome=\"completed\"] title').textContent",
    )
    .await;
    let title = title.as_str().unwrap();
    assert!(
        title.contains("token 2") && title.contains(" ago") && title.contains("ran ") && title.contains("Z"),
        "relative and absolute times: {title}"
    );
    let summary = eval(&browser, "document.getElementById('rec-summary').textContent").await;
    assert!(
        summary.as_str().unwrap().contains("1 coalesced trigger"),
        "{summary}"
    );
    let rows = eval(
        &browser,
        "Array.from(document.querySelectorAll('#rec-history tbody tr')).map(r => r.dataset.event)",
    )
    .await;
    let mut events: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(events.first(), Some(&"completed"), "newest first: {events:?}");
    assert_eq!(events.last(), Some(&"started"), "{events:?}");
    events.sort_unstable();
    assert_eq!(
        events,
        ["coalesced", "completed", "retriggered", "started", "started"],
        "{rows}"
    );
    let first = eval(
        &browser,
        "Array.from(document.querySelector('#rec-history tbody tr').querySelectorAll('td')).map(c => c.textContent)",
    )
    .await;
    let cells: Vec<&str> = first
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(
        cells[0].contains(" ago") && cells[0].ends_with('Z'),
        "time: {cells:?}"
    );
    assert_eq!(cells[3], "2", "token: {cells:?}");
    assert!(cells[7].contains("ran "), "run time: {cells:?}");
    let poison = wait(
        &browser,
        "document.querySelector('#rec-poison tbody tr') && document.querySelector('#rec-poison tbody tr').textContent",
        "the record's poison entry",
    )
    .await;
    assert!(
        poison.as_str().unwrap().contains("<img id=injected-rec src=x>"),
        "{poison}"
    );
    assert_eq!(
        eval(&browser, "document.getElementById('injected-rec') === null").await,
        true
    );
    let shot = workspace_root().join("target/dashboard/record-page.png");
    browser.save_screenshot(&shot).await.unwrap();

    // "Run it again": `enqueued` in its history, then a third run on its timeline.
    eval(&browser, "document.getElementById('rec-enqueue').click(); true").await;
    let said = toasts(&browser, "the enqueue's answer").await;
    assert!(said.as_str().unwrap().contains("enqueued account/"), "{said}");
    wait(
        &browser,
        "!!document.querySelector('#rec-history tbody tr[data-event=\"enqueued\"]')",
        "the enqueued entry",
    )
    .await;
    wait(
        &browser,
        "document.querySelectorAll('#rec-timeline rect.bar[data-outcome=\"completed\"]').length === 2 && \
         document.querySelectorAll('#rec-timeline rect.bar').length === 3",
        "the third run on the timeline",
    )
    .await;
    assert_eq!(env.runs().iter().filter(|r| *r == RECORD).count(), 3);

    // The run list: every scope's runs, then the account scope's completed ones only.
    eval(&browser, "document.getElementById('tab-runs').click(); true").await;
    wait(
        &browser,
        &format!(
            "!document.getElementById('runs-view').hidden && \
             !!document.querySelector('#runs tbody tr[data-record=\"contact/contact-0042\"]') && \
             document.querySelectorAll('#runs tbody tr[data-record=\"account/{RECORD}\"]').length === 3"
        ),
        "every scope's runs",
    )
    .await;
    eval(
        &browser,
        "document.getElementById('runs-scope').value = 'account'; \
         document.getElementById('runs-outcome').value = 'completed'; \
         document.getElementById('runs-since').value = '15m'; \
         document.getElementById('runs-filter').requestSubmit(); true",
    )
    .await;
    let shown = wait(
        &browser,
        "(() => { const r = Array.from(document.querySelectorAll('#runs tbody tr')).map(r => r.dataset.record + ' ' + r.dataset.outcome); \
          return location.hash.includes('scope=account') && r.length === 2 && r; })()",
        "the account scope's completed runs",
    )
    .await;
    assert_eq!(
        shown,
        json!([
            format!("account/{RECORD} completed"),
            format!("account/{RECORD} completed")
        ])
    );
    assert_eq!(
        eval(&browser, "location.hash").await,
        "#runs?scope=account&outcome=completed&since=15m"
    );
    // A row links to its record's page.
    eval(
        &browser,
        &format!("document.querySelector('#runs tbody tr a[href=\"{page}\"]').click(); true"),
    )
    .await;
    wait(
        &browser,
        "!document.getElementById('record-view').hidden && document.getElementById('runs-view').hidden",
        "the record page from the run list",
    )
    .await;
    assert_eq!(browser.exceptions(), Vec::<String>::new(), "the page threw");
    app.stop().await;
    drop(browser);
    eprintln!("record page browser test took {:?}", started.elapsed());
}
