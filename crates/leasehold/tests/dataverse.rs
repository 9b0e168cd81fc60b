//! `leasehold dataverse register | list | unregister`, the real binary against a local server
//! that enforces the Dataverse Web API's documented request shapes (tests/dataverse_api).

mod dataverse_api;

use std::time::{Duration, Instant};

use dataverse_api::{FakeDataverse, Force};
use serde_json::{Value, json};

const KEY_1: &str = "k1-Zm9vYmFyLWZ1bmN0aW9uLWtleS0xAAAAAAAAAA==";
const KEY_2: &str = "k2-cm90YXRlZC1mdW5jdGlvbi1rZXktMgBBBBBBBB==";
const START: &str = "https://func-leaseholddev.azurewebsites.net/api/start";
const NAME: &str = "leasehold-func-leaseholddev.azurewebsites.net";

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Runs `leasehold dataverse …` with the token (when given) and the key in the environment.
async fn leasehold(token: Option<&str>, key: Option<&str>, args: &[&str]) -> Run {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_leasehold"));
    command.arg("dataverse").args(args).kill_on_drop(true);
    for var in [
        "DATAVERSE_ACCESS_TOKEN",
        "AZURE_TENANT_ID",
        "AZURE_CLIENT_ID",
        "AZURE_CLIENT_SECRET",
        "LEASEHOLD_START_KEY",
        "DATAVERSE_ENVIRONMENT_URL",
    ] {
        command.env_remove(var);
    }
    if let Some(t) = token {
        command.env("DATAVERSE_ACCESS_TOKEN", t);
    }
    if let Some(k) = key {
        command.env("LEASEHOLD_START_KEY", k);
    }
    let started = Instant::now();
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("leasehold dataverse finished within 120 s")
        .expect("leasehold runs");
    let run = Run {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        took: started.elapsed(),
    };
    for secret in [KEY_1, KEY_2, "PRIYAS-SECRET-CODE"].into_iter().chain(token) {
        assert!(
            !run.stdout.contains(secret) && !run.stderr.contains(secret),
            "a secret was printed:\n{}\n{}",
            run.stdout,
            run.stderr
        );
    }
    run
}

fn register_args<'a>(server: &'a FakeDataverse, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "register",
        "--environment-url",
        server.url.as_str(),
        "--start-url",
        START,
        "--table",
        "account",
    ];
    args.extend_from_slice(extra);
    args
}

const CREATE_UPDATE: &[&str] = &[
    "--messages",
    "Create,Update",
    "--filtering-attributes",
    "name,statuscode",
];

fn step_by_message(server: &FakeDataverse, message: &str) -> serde_json::Map<String, Value> {
    let st = server.state();
    let name = format!("{NAME}: {message} of account");
    st.steps
        .values()
        .find(|s| s["name"] == json!(name))
        .unwrap_or_else(|| panic!("no step named {name}: {:?}", st.steps))
        .clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn register_creates_then_changes_nothing_then_rotates_only_the_key_then_unregisters() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();

    // 1. First run: the endpoint and one step per message.
    let run = leasehold(Some(&token), Some(KEY_1), &register_args(&server, CREATE_UPDATE)).await;
    assert!(run.ok, "register failed:\n{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains(&format!("endpoint {NAME}")), "{}", run.stdout);
    assert!(run.stdout.contains("created"), "{}", run.stdout);
    let (endpoint_id, endpoint) = {
        let st = server.state();
        assert_eq!(st.endpoints.len(), 1, "{:?}", st.endpoints);
        let (id, e) = st.endpoints.iter().next().unwrap();
        (*id, e.clone())
    };
    assert_eq!(endpoint["name"], json!(NAME));
    assert_eq!(endpoint["url"], json!(START));
    assert_eq!(endpoint["contract"], json!(8));
    assert_eq!(endpoint["authtype"], json!(4));
    assert_eq!(endpoint["messageformat"], json!(2));
    assert_eq!(endpoint["authvalue"], json!(KEY_1));
    assert_eq!(server.state().steps.len(), 2);
    for message in ["Create", "Update"] {
        let step = step_by_message(&server, message);
        assert_eq!(step["_eventhandler_value"], json!(endpoint_id.to_string()));
        assert_eq!(step["stage"], json!(40));
        assert_eq!(step["mode"], json!(1));
        assert_eq!(step["rank"], json!(1));
        assert_eq!(step["supporteddeployment"], json!(0));
        assert_eq!(step["asyncautodelete"], json!(true));
    }
    assert_eq!(
        step_by_message(&server, "Update")["filteringattributes"],
        json!("name,statuscode")
    );
    assert!(
        step_by_message(&server, "Create")
            .get("filteringattributes")
            .is_none()
    );
    let steps_before = server.state().steps.clone();
    let writes_before = server.state().writes.len();
    assert_eq!(
        writes_before,
        3,
        "one endpoint and two steps: {:?}",
        server.state().writes
    );

    // 2. Second run: reads only, and says so.
    let run = leasehold(Some(&token), Some(KEY_1), &register_args(&server, CREATE_UPDATE)).await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("nothing changed"), "{}", run.stdout);
    assert_eq!(
        server.state().writes.len(),
        writes_before,
        "{:?}",
        server.state().writes
    );

    // 3. A rotated key (from a file this time): one PATCH of the endpoint, steps untouched.
    let dir = std::env::temp_dir().join(format!("leasehold-dv-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("start.key");
    std::fs::write(&key_file, format!("{KEY_2}\n")).unwrap();
    let key_path = key_file.to_str().unwrap().to_owned();
    let mut args = register_args(&server, CREATE_UPDATE);
    args.extend(["--start-key-file", key_path.as_str()]);
    let run = leasehold(Some(&token), None, &args).await;
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("key set"), "{}", run.stdout);
    {
        let st = server.state();
        let new_writes = &st.writes[writes_before..];
        assert_eq!(new_writes.len(), 1, "{new_writes:?}");
        assert!(
            new_writes[0].starts_with(&format!("PATCH /api/data/v9.2/serviceendpoints({endpoint_id})")),
            "{new_writes:?}"
        );
        assert_eq!(st.endpoints[&endpoint_id]["authvalue"], json!(KEY_2));
        assert_eq!(st.steps, steps_before);
    }
    // And that key again: nothing.
    let writes = server.state().writes.len();
    let run = leasehold(Some(&token), Some(KEY_2), &register_args(&server, CREATE_UPDATE)).await;
    assert!(
        run.ok && run.stdout.contains("nothing changed"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    assert_eq!(server.state().writes.len(), writes);

    // 4. list: the endpoint and its steps, as text and as JSON.
    let run = leasehold(Some(&token), None, &["list", "--environment-url", &server.url]).await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    for expect in [
        NAME,
        START,
        "key  set (fingerprint",
        "step account Create: post-operation, asynchronous, rank 1, succeeded jobs deleted",
        "step account Update: post-operation, asynchronous, rank 1, succeeded jobs deleted, filtering attributes name,statuscode",
    ] {
        assert!(
            run.stdout.contains(expect),
            "list lacks '{expect}':\n{}",
            run.stdout
        );
    }
    let run = leasehold(
        Some(&token),
        None,
        &["list", "--environment-url", &server.url, "--json"],
    )
    .await;
    let listed: Value = serde_json::from_str(&run.stdout).expect("list --json is JSON");
    assert_eq!(listed["endpoints"][0]["id"], json!(endpoint_id.to_string()));
    assert_eq!(listed["endpoints"][0]["keySet"], json!(true));
    assert_eq!(listed["endpoints"][0]["steps"].as_array().unwrap().len(), 2);

    // 5. unregister: the endpoint, and with it its steps.
    let run = leasehold(
        Some(&token),
        None,
        &["unregister", "--environment-url", &server.url, "--yes"],
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("removed endpoint") && run.stdout.contains("2 step(s)"),
        "{}",
        run.stdout
    );
    assert!(server.state().endpoints.is_empty());
    assert!(server.state().steps.is_empty());
    let run = leasehold(Some(&token), None, &["list", "--environment-url", &server.url]).await;
    assert!(
        run.stdout.contains("no Leasehold webhook endpoints"),
        "{}",
        run.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_no_longer_asked_for_loses_its_step_and_other_tables_keep_theirs() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    let contact = [
        "register",
        "--environment-url",
        &server.url,
        "--start-url",
        START,
        "--table",
        "contact",
        "--messages",
        "Create",
    ];
    assert!(leasehold(Some(&token), Some(KEY_1), &contact).await.ok);
    assert!(
        leasehold(Some(&token), Some(KEY_1), &register_args(&server, CREATE_UPDATE))
            .await
            .ok
    );
    assert_eq!(server.state().steps.len(), 3);
    let run = leasehold(
        Some(&token),
        Some(KEY_1),
        &register_args(&server, &["--messages", "Create"]),
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("step account Update") && run.stdout.contains("removed"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("step contact Create") && run.stdout.contains("kept (another table)"),
        "{}",
        run.stdout
    );
    let names: Vec<Value> = server.state().steps.values().map(|s| s["name"].clone()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.contains(&json!(format!("{NAME}: Create of account"))));
    assert!(names.contains(&json!(format!("{NAME}: Create of contact"))));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_table_that_does_not_support_the_message_is_named_and_nothing_is_written() {
    let server = FakeDataverse::start().await;
    let args = [
        "register",
        "--environment-url",
        &server.url,
        "--start-url",
        START,
        "--table",
        "systemuser",
        "--messages",
        "Create,Delete",
    ];
    let run = leasehold(Some(&server.token), Some(KEY_1), &args).await;
    assert!(!run.ok, "{}", run.stdout);
    assert!(
        run.stderr
            .contains("table 'systemuser' does not support the message 'Delete'"),
        "{}",
        run.stderr
    );
    assert!(server.state().writes.is_empty(), "{:?}", server.state().writes);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_401_names_the_credential_and_the_role_needed() {
    let server = FakeDataverse::start().await;
    let run = leasehold(
        Some("not-the-right-token"),
        Some(KEY_1),
        &register_args(&server, CREATE_UPDATE),
    )
    .await;
    assert!(!run.ok);
    for expect in [
        "401 Unauthorized",
        "the bearer token in DATAVERSE_ACCESS_TOKEN",
        "Service Endpoint",
        "SDK Message Processing Step",
        "System Customizer or System Administrator",
    ] {
        assert!(
            run.stderr.contains(expect),
            "the error lacks '{expect}':\n{}",
            run.stderr
        );
    }
    assert!(server.state().writes.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_429_waits_for_retry_after_and_then_succeeds() {
    let server = FakeDataverse::start().await;
    server.force(Force {
        status: 429,
        retry_after: Some(1),
        times: 2,
    });
    let run = leasehold(
        Some(&server.token),
        Some(KEY_1),
        &register_args(&server, CREATE_UPDATE),
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("429 Too Many Requests"), "{}", run.stderr);
    assert!(run.took >= Duration::from_secs(2), "waited only {:?}", run.took);
    assert_eq!(server.state().endpoints.len(), 1);
    assert_eq!(server.state().steps.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_sends_nothing_needs_no_credential_and_redacts_the_key() {
    let server = FakeDataverse::start().await;
    let mut args = register_args(&server, CREATE_UPDATE);
    args.push("--dry-run");
    let run = leasehold(None, Some(KEY_1), &args).await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        server.state().requests.is_empty(),
        "{:?}",
        server.state().requests
    );
    for expect in [
        "\"authvalue\": \"<redacted>\"",
        &format!("POST {}/api/data/v9.2/serviceendpoints", server.url),
        &format!("POST {}/api/data/v9.2/sdkmessageprocessingsteps", server.url),
        "\"eventhandler_serviceendpoint@odata.bind\"",
        "\"filteringattributes\": \"name,statuscode\"",
    ] {
        assert!(
            run.stdout.contains(expect),
            "the plan lacks '{expect}':\n{}",
            run.stdout
        );
    }
    let run = leasehold(
        None,
        None,
        &["unregister", "--environment-url", &server.url, "--dry-run"],
    )
    .await;
    assert!(
        run.ok && run.stdout.contains("DELETE"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    assert!(server.state().requests.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_http_is_refused_except_on_loopback_and_a_key_in_the_start_url_too() {
    let run = leasehold(
        Some("unused-token-0d8a"),
        Some(KEY_1),
        &[
            "register",
            "--environment-url",
            "http://contoso.crm4.dynamics.com",
            "--start-url",
            START,
            "--table",
            "account",
            "--messages",
            "Create",
        ],
    )
    .await;
    assert!(!run.ok && run.stderr.contains("must be https"), "{}", run.stderr);
    let run = leasehold(
        Some("unused-token-0d8a"),
        Some(KEY_1),
        &[
            "register",
            "--environment-url",
            "https://contoso.crm4.dynamics.com",
            "--start-url",
            "https://func-x.azurewebsites.net/api/start?code=abc",
            "--table",
            "account",
            "--messages",
            "Create",
            "--dry-run",
        ],
    )
    .await;
    assert!(!run.ok && run.stderr.contains("?code="), "{}", run.stderr);
}

/// Requests to the stand-in's Web API, authorised with its token.
struct WebApi {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl WebApi {
    fn new(server: &FakeDataverse) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: format!("{}/api/data/v9.2/", server.url),
            token: server.token.clone(),
        }
    }

    /// `method path` with a JSON `body` (if any), with or without the OData headers.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        odata: bool,
    ) -> reqwest::Response {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("Accept", "application/json");
        if odata {
            r = r.header("OData-Version", "4.0").header("OData-MaxVersion", "4.0");
        }
        if let Some(b) = body {
            r = r
                .header("Content-Type", "application/json; charset=utf-8")
                .body(b.to_string());
        }
        r.send().await.unwrap()
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        self.send(reqwest::Method::GET, path, None, true).await
    }

    async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.send(reqwest::Method::POST, path, Some(body), true).await
    }

    async fn delete(&self, path: &str) -> reqwest::Response {
        self.send(reqwest::Method::DELETE, path, None, true).await
    }
}

/// The stand-in refuses what the documentation says Dataverse refuses, so the tests above
/// prove the shapes and not merely agreement with a lenient fake.
#[tokio::test(flavor = "multi_thread")]
async fn the_stand_in_refuses_what_dataverse_refuses() {
    let server = FakeDataverse::start().await;
    let api = WebApi::new(&server);
    let endpoint = json!({"name": "leasehold-x", "url": START, "contract": 8, "authtype": 4,
        "authvalue": "k", "messageformat": 2, "userclaim": 1, "connectionmode": 1});
    // Without the OData headers: 400 with the Web API's error body.
    let r = api
        .send(
            reqwest::Method::POST,
            "serviceendpoints",
            Some(endpoint.clone()),
            false,
        )
        .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["code"].as_str().unwrap().starts_with("0x"),
        "{body}"
    );
    // A create: 204 and OData-EntityId.
    let r = api.post("serviceendpoints", endpoint.clone()).await;
    assert_eq!(r.status(), 204);
    let entity = r.headers()["OData-EntityId"].to_str().unwrap().to_owned();
    assert!(
        entity.starts_with(&format!("{}serviceendpoints(", api.base)),
        "{entity}"
    );
    let id = &entity[entity.find('(').unwrap() + 1..entity.len() - 1];
    // Another contract, an unknown property: refused.
    let mut wrong = endpoint.clone();
    wrong["contract"] = json!(1);
    assert_eq!(api.post("serviceendpoints", wrong).await.status(), 400);
    let mut wrong = endpoint.clone();
    wrong["Name"] = json!("x");
    assert_eq!(api.post("serviceendpoints", wrong).await.status(), 400);
    // authvalue cannot be read.
    let r = api.get("serviceendpoints?$select=authvalue").await;
    assert_eq!(r.status(), 400);
    // A step bound with a PascalCase navigation property: the real "undeclared property" 400.
    let filters: Value = api
        .get("sdkmessagefilters?$select=sdkmessagefilterid,_sdkmessageid_value&$filter=sdkmessageid/name%20eq%20'Update'%20and%20primaryobjecttypecode%20eq%20'account'")
        .await
        .json()
        .await
        .unwrap();
    let filter = &filters["value"][0];
    let step = |nav: &str| {
        json!({"name": "s", "stage": 40, "mode": 1, "rank": 1, "supporteddeployment": 0, "asyncautodelete": true,
            nav: format!("/serviceendpoints({id})"),
            "sdkmessageid@odata.bind": format!("/sdkmessages({})", filter["_sdkmessageid_value"].as_str().unwrap()),
            "sdkmessagefilterid@odata.bind": format!("/sdkmessagefilters({})", filter["sdkmessagefilterid"].as_str().unwrap())})
    };
    let r = api
        .post(
            "sdkmessageprocessingsteps",
            step("EventHandler_ServiceEndpoint@odata.bind"),
        )
        .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("undeclared property"),
        "{body}"
    );
    // Asynchronous but not post-operation: refused.
    let mut pre = step("eventhandler_serviceendpoint@odata.bind");
    pre["stage"] = json!(20);
    assert_eq!(api.post("sdkmessageprocessingsteps", pre).await.status(), 400);
    // Spaces as '+': refused.
    let r = api.get("serviceendpoints?$filter=contract+eq+8").await;
    assert_eq!(r.status(), 400);
    // The right step: created; deleting the endpoint deletes it.
    let r = api
        .post(
            "sdkmessageprocessingsteps",
            step("eventhandler_serviceendpoint@odata.bind"),
        )
        .await;
    assert_eq!(r.status(), 204);
    assert_eq!(server.state().steps.len(), 1);
    let r = api.delete(&format!("serviceendpoints({id})")).await;
    assert_eq!(r.status(), 204);
    assert!(server.state().steps.is_empty());
}

/// A description `register` writes: the marker line for `name`.
fn marked(name: &str) -> String {
    format!(
        "Leasehold's Start webhook\n[leasehold-managed endpoint={name}] written by `leasehold dataverse register`, which updates and deletes this endpoint and its steps; without this line it leaves the endpoint alone"
    )
}

/// An endpoint's fields as the Web API stores them.
fn endpoint_record(name: &str, url: &str, description: &str) -> Value {
    json!({"name": name, "url": url, "contract": 8, "authtype": 4, "authvalue": "someone-elses-key",
        "messageformat": 2, "userclaim": 1, "connectionmode": 1, "description": description})
}

/// Someone else's webhook, named like Leasehold's: `leasehold-sync`, with two steps.
fn seed_foreign(server: &FakeDataverse) -> uuid::Uuid {
    let mut st = server.state();
    let priya = st.add_user("Priya Shah");
    let id = st.seed_endpoint(
        endpoint_record(
            "leasehold-sync",
            "https://sync.contoso-property.example/hooks/lease?code=PRIYAS-SECRET-CODE",
            "Pushes lease changes to the property ledger",
        ),
        priya,
    );
    st.seed_step(id, "account", "Create", json!({}), priya);
    st.seed_step(id, "account", "Update", json!({}), priya);
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn unregister_leaves_someone_elses_endpoint_alone_and_refuses_it_by_name() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    let foreign = seed_foreign(&server);

    // Without --name: Leasehold has nothing here; the foreign endpoint is left alone and named
    // (and nothing is asked: there is nothing to delete).
    let run = leasehold(
        Some(&token),
        None,
        &["unregister", "--environment-url", &server.url],
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("nothing to remove"), "{}", run.stdout);
    assert!(
        run.stdout
            .contains(&format!("left alone: endpoint leasehold-sync ({foreign})")),
        "{}",
        run.stdout
    );
    assert!(server.state().writes.is_empty(), "{:?}", server.state().writes);

    // By name: refused, saying whose it looks like and how to force it.
    let run = leasehold(
        Some(&token),
        None,
        &[
            "unregister",
            "--environment-url",
            &server.url,
            "--name",
            "leasehold-sync",
        ],
    )
    .await;
    assert!(!run.ok, "{}", run.stdout);
    for expect in [
        "is not Leasehold's",
        &format!("endpoint leasehold-sync ({foreign})"),
        "https://sync.contoso-property.example/hooks/lease?code=<redacted>",
        "\"Pushes lease changes to the property ledger\"",
        "by Priya Shah",
        "someone else's",
        "--name leasehold-sync --force",
    ] {
        assert!(
            run.stderr.contains(expect),
            "the refusal lacks '{expect}':\n{}",
            run.stderr
        );
    }
    assert!(server.state().writes.is_empty(), "{:?}", server.state().writes);
    assert_eq!(server.state().endpoints.len(), 1);
    assert_eq!(server.state().steps.len(), 2);

    // list says so too.
    let run = leasehold(Some(&token), None, &["list", "--environment-url", &server.url]).await;
    assert!(run.stdout.contains("NOT LEASEHOLD'S"), "{}", run.stdout);

    // Forced: deleted.
    let run = leasehold(
        Some(&token),
        None,
        &[
            "unregister",
            "--environment-url",
            &server.url,
            "--name",
            "leasehold-sync",
            "--force",
            "--yes",
        ],
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(server.state().endpoints.is_empty());
    assert!(server.state().steps.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn register_refuses_someone_elses_endpoint_of_its_name() {
    let server = FakeDataverse::start().await;
    let foreign = seed_foreign(&server);
    let before = server.state().endpoints[&foreign].clone();
    let run = leasehold(
        Some(&server.token),
        Some(KEY_1),
        &register_args(&server, &["--messages", "Create", "--name", "leasehold-sync"]),
    )
    .await;
    assert!(!run.ok, "{}", run.stdout);
    for expect in [
        "is not Leasehold's",
        "so `register` does not change it",
        "https://sync.contoso-property.example/hooks/lease",
        "by Priya Shah",
        "--adopt",
    ] {
        assert!(
            run.stderr.contains(expect),
            "the refusal lacks '{expect}':\n{}",
            run.stderr
        );
    }
    assert!(server.state().writes.is_empty(), "{:?}", server.state().writes);
    assert_eq!(server.state().endpoints[&foreign], before);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_from_before_the_marker_is_refused_until_adopted() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    let earlier = {
        let mut st = server.state();
        let deployer = st.caller;
        let id = st.seed_endpoint(
            endpoint_record(
                NAME,
                START,
                "Leasehold's Start webhook, managed by `leasehold dataverse register`; key fingerprint sha256:0123456789abcdef",
            ),
            deployer,
        );
        st.seed_step(
            id,
            "account",
            "Create",
            json!({"name": format!("{NAME}: Create of account")}),
            deployer,
        );
        id
    };
    let run = leasehold(
        Some(&token),
        Some(KEY_1),
        &register_args(&server, &["--messages", "Create"]),
    )
    .await;
    assert!(!run.ok, "{}", run.stdout);
    assert!(
        run.stderr.contains("an earlier leasehold's") && run.stderr.contains("--adopt"),
        "{}",
        run.stderr
    );
    assert!(server.state().writes.is_empty());
    let run = leasehold(
        Some(&token),
        None,
        &[
            "unregister",
            "--environment-url",
            &server.url,
            "--name",
            NAME,
            "--yes",
        ],
    )
    .await;
    assert!(!run.ok && run.stderr.contains("--adopt"), "{}", run.stderr);

    // Adopted: the same endpoint, rewritten with the marker; its step kept.
    let run = leasehold(
        Some(&token),
        Some(KEY_1),
        &register_args(&server, &["--messages", "Create", "--adopt"]),
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("adopted: marker written"), "{}", run.stdout);
    {
        let st = server.state();
        assert_eq!(st.endpoints.len(), 1);
        let description = st.endpoints[&earlier]["description"].as_str().unwrap().to_owned();
        assert!(
            description.contains(&format!("[leasehold-managed endpoint={NAME}]")),
            "{description}"
        );
        assert_eq!(st.endpoints[&earlier]["authvalue"], json!(KEY_1));
        assert_eq!(st.steps.len(), 1);
    }
    // From now on it is Leasehold's: no flag needed.
    let run = leasehold(
        Some(&token),
        Some(KEY_1),
        &register_args(&server, &["--messages", "Create"]),
    )
    .await;
    assert!(
        run.ok && run.stdout.contains("nothing changed"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unregister_lists_what_it_deletes_and_without_a_terminal_deletes_only_with_yes() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    let run = leasehold(Some(&token), Some(KEY_1), &register_args(&server, CREATE_UPDATE)).await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    let writes = server.state().writes.len();
    let (endpoint, steps) = {
        let st = server.state();
        let steps: Vec<(uuid::Uuid, String)> = st
            .steps
            .iter()
            .map(|(id, s)| (*id, s["name"].as_str().unwrap().to_owned()))
            .collect();
        (*st.endpoints.keys().next().unwrap(), steps)
    };
    // The test's stdin is not a terminal: no question can be asked, so nothing is deleted.
    let run = leasehold(
        Some(&token),
        None,
        &["unregister", "--environment-url", &server.url],
    )
    .await;
    assert!(!run.ok, "{}", run.stdout);
    assert!(
        run.stderr.contains(&format!("endpoint {NAME} ({endpoint})")),
        "{}",
        run.stderr
    );
    for (id, name) in &steps {
        assert!(
            run.stderr.contains(&format!("step {name} ({id})")),
            "the listing lacks step {name} ({id}):\n{}",
            run.stderr
        );
    }
    assert!(
        run.stderr.contains("nothing deleted") && run.stderr.contains("--yes"),
        "{}",
        run.stderr
    );
    assert_eq!(server.state().writes.len(), writes, "{:?}", server.state().writes);
    assert_eq!(server.state().endpoints.len(), 1);
    // --yes: deleted.
    let run = leasehold(
        Some(&token),
        None,
        &["unregister", "--environment-url", &server.url, "--yes"],
    )
    .await;
    assert!(
        run.ok && run.stdout.contains("removed endpoint"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    assert!(server.state().endpoints.is_empty() && server.state().steps.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn two_registers_at_once_end_with_one_endpoint_and_one_set_of_steps() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    // Both runs read "nothing there" before either create lands: the stand-in holds the first
    // create until the second has arrived.
    server.hold_creates("serviceendpoints", 2);
    let args = register_args(&server, CREATE_UPDATE);
    let (a, b) = tokio::join!(
        leasehold(Some(&token), Some(KEY_1), &args),
        leasehold(Some(&token), Some(KEY_1), &args)
    );
    for run in [&a, &b] {
        assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    }
    {
        let st = server.state();
        assert_eq!(st.holds_released, 1, "the two creates were not held together");
        assert_eq!(
            st.writes
                .iter()
                .filter(|w| w.starts_with("POST /api/data/v9.2/serviceendpoints"))
                .count(),
            2,
            "{:?}",
            st.writes
        );
        assert_eq!(
            st.endpoints.len(),
            1,
            "two registers at once left {:?}",
            st.endpoints
        );
        let (kept, endpoint) = st.endpoints.iter().next().unwrap();
        assert!(
            endpoint["description"]
                .as_str()
                .unwrap()
                .contains(&format!("[leasehold-managed endpoint={NAME}]"))
        );
        // The older of the two is the one kept.
        assert_eq!(
            endpoint["createdon"],
            json!("2026-11-23T09:00:00Z"),
            "{endpoint:?}"
        );
        assert_eq!(st.steps.len(), 2, "{:?}", st.steps);
        for s in st.steps.values() {
            assert_eq!(s["_eventhandler_value"], json!(kept.to_string()));
        }
    }
    let removed = format!("{}{}", a.stdout, b.stdout);
    assert!(removed.contains("duplicate endpoint"), "{removed}");
    // And then all is as asked: a third run writes nothing.
    let writes = server.state().writes.len();
    let run = leasehold(Some(&token), Some(KEY_1), &args).await;
    assert!(
        run.ok && run.stdout.contains("nothing changed"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    assert_eq!(server.state().writes.len(), writes);

    // Steps race the same way: a table added by two runs at once gets one step.
    server.hold_creates("sdkmessageprocessingsteps", 2);
    let contact = [
        "register",
        "--environment-url",
        &server.url,
        "--start-url",
        START,
        "--table",
        "contact",
        "--messages",
        "Create",
    ];
    let (a, b) = tokio::join!(
        leasehold(Some(&token), Some(KEY_1), &contact),
        leasehold(Some(&token), Some(KEY_1), &contact)
    );
    for run in [&a, &b] {
        assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    }
    let st = server.state();
    assert_eq!(
        st.holds_released, 2,
        "the two step creates were not held together"
    );
    let contact_steps = st
        .steps
        .values()
        .filter(|s| s["name"] == json!(format!("{NAME}: Create of contact")))
        .count();
    assert_eq!(contact_steps, 1, "{:?}", st.steps);
    assert_eq!(st.steps.len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn register_repairs_the_duplicate_a_run_that_stopped_half_way_left() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    let (older, newer, moved) = {
        let mut st = server.state();
        let deployer = st.caller;
        let older = st.seed_endpoint(endpoint_record(NAME, START, &marked(NAME)), deployer);
        let newer = st.seed_endpoint(endpoint_record(NAME, START, &marked(NAME)), deployer);
        st.seed_step(
            older,
            "account",
            "Create",
            json!({"name": format!("{NAME}: Create of account")}),
            deployer,
        );
        st.seed_step(
            newer,
            "account",
            "Create",
            json!({"name": format!("{NAME}: Create of account")}),
            deployer,
        );
        let moved = st.seed_step(
            newer,
            "contact",
            "Create",
            json!({"name": format!("{NAME}: Create of contact")}),
            deployer,
        );
        (older, newer, moved)
    };
    let run = leasehold(
        Some(&token),
        Some(KEY_1),
        &register_args(&server, &["--messages", "Create"]),
    )
    .await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains(&format!("duplicate endpoint {NAME} ({newer}"))
            && run.stdout.contains("removed"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains(&format!("contact Create ({moved})")),
        "{}",
        run.stdout
    );
    let st = server.state();
    assert_eq!(st.endpoints.keys().collect::<Vec<_>>(), [&older]);
    assert_eq!(st.steps.len(), 2, "{:?}", st.steps);
    assert_eq!(st.steps[&moved]["_eventhandler_value"], json!(older.to_string()));
    for s in st.steps.values() {
        assert_eq!(s["_eventhandler_value"], json!(older.to_string()));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn register_enables_a_disabled_step_and_says_so() {
    let server = FakeDataverse::start().await;
    let token = server.token.clone();
    let args = register_args(&server, CREATE_UPDATE);
    assert!(leasehold(Some(&token), Some(KEY_1), &args).await.ok);
    let disabled = {
        let mut st = server.state();
        let (id, step) = st
            .steps
            .iter_mut()
            .find(|(_, s)| s["name"] == json!(format!("{NAME}: Create of account")))
            .unwrap();
        step.insert("statecode".into(), json!(1));
        step.insert("statuscode".into(), json!(2));
        *id
    };
    let run = leasehold(Some(&token), Some(KEY_1), &args).await;
    assert!(run.ok, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains(&format!(
            "step account Create ({disabled}): updated (it was disabled: enabled)"
        )),
        "{}",
        run.stdout
    );
    assert!(!run.stdout.contains("nothing changed"), "{}", run.stdout);
    let st = server.state();
    assert_eq!(st.steps[&disabled]["statecode"], json!(0));
    assert_eq!(st.steps[&disabled]["statuscode"], json!(1));
}
