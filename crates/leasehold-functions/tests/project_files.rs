//! The Functions project files agree with the code: function names, binding names, the queue
//! setting and the custom-handler entry point.

use leasehold_functions::handler::{
    HTTP_IN, HTTP_OUT, QUEUE_IN, QUEUE_OUT, QUEUE_OUT_LOW, START_FUNCTION, WORKER_FUNCTION,
    WORKER_LOW_FUNCTION,
};
use serde_json::Value;

fn read(path: &str) -> Value {
    let full = leasehold_test_support::workspace_root().join(path);
    let text = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON: {e}"))
}

fn binding<'a>(function: &'a Value, name: &str) -> &'a Value {
    function["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == name)
        .unwrap_or_else(|| panic!("no binding named {name:?}"))
}

#[test]
fn start_and_worker_bindings_match_the_handler() {
    let start = read(&format!("{START_FUNCTION}/function.json"));
    let req = binding(&start, HTTP_IN);
    assert_eq!(req["type"], "httpTrigger");
    assert_eq!(
        req["authLevel"], "function",
        "the host must check the key before calling the handler"
    );
    assert_eq!(req["route"], "start", "Start is POST /api/start in both modes");
    assert_eq!(binding(&start, HTTP_OUT)["type"], "http");
    let out = binding(&start, QUEUE_OUT);
    assert_eq!(
        (out["type"].as_str(), out["queueName"].as_str()),
        (Some("queue"), Some("%LEASEHOLD_QUEUE%"))
    );
    assert_eq!(out["connection"], "AzureWebJobsStorage");
    // The low lane: its queue is the trigger queue's name with `-low` (low_queue_name).
    let low = binding(&start, QUEUE_OUT_LOW);
    assert_eq!(
        (low["type"].as_str(), low["queueName"].as_str()),
        (Some("queue"), Some("%LEASEHOLD_QUEUE%-low"))
    );
    assert_eq!(low["connection"], "AzureWebJobsStorage");
    assert_eq!(
        leasehold_runtime::low_queue_name("%LEASEHOLD_QUEUE%"),
        "%LEASEHOLD_QUEUE%-low"
    );

    // Each lane its own queue-triggered function, so Flex Consumption scales them apart.
    for (function, queue) in [
        (WORKER_FUNCTION, "%LEASEHOLD_QUEUE%"),
        (WORKER_LOW_FUNCTION, "%LEASEHOLD_QUEUE%-low"),
    ] {
        let worker = read(&format!("{function}/function.json"));
        let trigger = binding(&worker, QUEUE_IN);
        assert_eq!(trigger["type"], "queueTrigger");
        assert_eq!(trigger["queueName"], queue, "{function}");
        assert_eq!(trigger["connection"], "AzureWebJobsStorage");
        assert_eq!(worker["bindings"].as_array().unwrap().len(), 1, "{function}");
    }
}

/// The dashboard's functions (handled by the `leasehold` crate's `admin` module): anonymous to
/// the host, because the handler checks `LEASEHOLD_ADMIN_KEY` itself (a key that opens only the
/// dashboard, where the master key opens the whole Function App, and a check that also stands
/// for local processes reaching the handler's port); the page holds no data; and no route the
/// host reserves for itself (it refuses to load a function whose route starts with `admin`).
#[test]
fn the_dashboard_functions_leave_the_key_to_the_handler_and_never_ask_for_the_master_key() {
    let ops = read("Ops/function.json");
    let req = binding(&ops, HTTP_IN);
    assert_eq!(req["type"], "httpTrigger");
    assert_eq!(
        req["authLevel"], "anonymous",
        "the handler checks LEASEHOLD_ADMIN_KEY; the master key is never asked for"
    );
    assert_eq!(req["methods"], serde_json::json!(["get", "post"]));
    assert_eq!(req["route"], "ops/{*path}");
    assert_eq!(binding(&ops, HTTP_OUT)["type"], "http");
    assert_eq!(ops["bindings"].as_array().unwrap().len(), 2, "no other bindings");

    let page = read("Dashboard/function.json");
    let req = binding(&page, HTTP_IN);
    assert_eq!(
        req["authLevel"], "anonymous",
        "the page holds no data; its API needs the key"
    );
    assert_eq!(req["methods"], serde_json::json!(["get"]));
    assert_eq!(req["route"], "dashboard");
    assert_eq!(binding(&page, HTTP_OUT)["type"], "http");

    for function in ["Start", "Worker", "WorkerLow", "Ops", "Dashboard"] {
        for b in read(&format!("{function}/function.json"))["bindings"]
            .as_array()
            .unwrap()
        {
            if let Some(route) = b["route"].as_str() {
                let first = route.split('/').next().unwrap().to_ascii_lowercase();
                assert!(
                    !first.starts_with("admin") && !first.starts_with("runtime"),
                    "{function}: the host reserves the route {route}"
                );
            }
        }
    }
    for script in ["scripts/package.sh", "scripts/check-package.sh"] {
        let text = std::fs::read_to_string(leasehold_test_support::workspace_root().join(script)).unwrap();
        for folder in [
            "Ops/function.json",
            "Dashboard/function.json",
            "WorkerLow/function.json",
        ] {
            assert!(text.contains(folder), "{script} does not package {folder}");
        }
    }
}

#[test]
fn host_json_runs_the_custom_handler_with_consistent_queue_settings() {
    let host = read("host.json");
    let handler = &host["customHandler"]["description"];
    assert_eq!(handler["defaultExecutablePath"], "leasehold");
    assert_eq!(handler["arguments"][0], "handler");
    assert_eq!(host["customHandler"]["enableForwardingHttpRequest"], false);
    let queues = &host["extensions"]["queues"];
    assert_eq!(
        queues["messageEncoding"], "base64",
        "the trigger message wire format is base64"
    );
    // The handler counts deliveries and gives a trigger up itself, with its reason and a sweep
    // (LEASEHOLD_MAX_DEQUEUE_COUNT, default 5). The host's own limit counts every failed
    // invocation, those of a handler that was down too, and poisons with no reason and no sweep:
    // it must never act first while the handler could. 100 invocations, `visibilityTimeout`
    // apart, let a handler be down for over 8 minutes (a bad deploy) first.
    let host_limit = queues["maxDequeueCount"].as_u64().unwrap();
    let retry_secs: u64 = queues["visibilityTimeout"]
        .as_str()
        .unwrap()
        .split(':')
        .fold(0, |acc, part| acc * 60 + part.parse::<u64>().unwrap());
    assert!(
        host_limit >= 20 * 5 && host_limit * retry_secs >= 8 * 60,
        "host.json maxDequeueCount {host_limit} (every {retry_secs} s) would poison before the handler's limit of 5 could act"
    );
    // An instance runs at most batchSize + newBatchThreshold deliveries at once. Each is a
    // record's logic (a process, minutes long) on an instance of 1–2 vCPUs (FC1 2 GB, EP1 1
    // vCPU), and a host that dies hides everything it dequeued for 10 minutes: keep it small.
    let concurrent = queues["batchSize"].as_u64().unwrap() + queues["newBatchThreshold"].as_u64().unwrap();
    assert!(
        concurrent <= 8,
        "{concurrent} concurrent runs per instance is too many for long logic on 1–2 vCPUs"
    );
    assert_eq!(
        host["functionTimeout"], "00:10:00",
        "the default run limit (9 min) must stay inside it"
    );
}

#[test]
fn local_settings_example_documents_every_setting() {
    let example = read("local.settings.example.json");
    let values = example["Values"].as_object().unwrap();
    let reference =
        std::fs::read_to_string(leasehold_test_support::workspace_root().join("docs/configuration.md"))
            .unwrap();
    let settings_src = std::fs::read_to_string(
        leasehold_test_support::workspace_root().join("crates/leasehold/src/settings.rs"),
    )
    .unwrap();
    for line in settings_src.lines() {
        let field = line.trim();
        if let Some(name) = field
            .strip_prefix("leasehold_")
            .and_then(|f| f.strip_suffix(": Option<String>,"))
        {
            let setting = format!("LEASEHOLD_{}", name.to_ascii_uppercase());
            assert!(
                values.contains_key(&setting),
                "{setting} is missing from local.settings.example.json"
            );
            assert!(
                reference.contains(&format!("`{setting}`")),
                "{setting} is missing from the configuration reference's table (docs/configuration.md)"
            );
        }
    }
    assert_eq!(values["FUNCTIONS_WORKER_RUNTIME"], "custom");
}

/// Settings the code reads: `AzureWebJobsStorage` and every `LEASEHOLD_*` field of the settings
/// struct, plus what function.json names (`%SETTING%` and `connection`).
fn settings_read() -> Vec<String> {
    let root = leasehold_test_support::workspace_root();
    let src = std::fs::read_to_string(root.join("crates/leasehold/src/settings.rs")).unwrap();
    let mut names: Vec<String> = src
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("leasehold_")
                .and_then(|f| f.strip_suffix(": Option<String>,"))
        })
        .map(|f| format!("LEASEHOLD_{}", f.to_ascii_uppercase()))
        .collect();
    names.push("AzureWebJobsStorage".into());
    names.push("LEASEHOLD_LOG_FORMAT".into()); // read by clap
    for function in [START_FUNCTION, WORKER_FUNCTION] {
        for b in read(&format!("{function}/function.json"))["bindings"]
            .as_array()
            .unwrap()
        {
            if let Some(q) = b["queueName"]
                .as_str()
                .and_then(|q| q.strip_prefix('%'))
                .and_then(|q| q.strip_suffix('%'))
            {
                names.push(q.to_string());
            }
            if let Some(c) = b["connection"].as_str() {
                names.push(c.to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

#[test]
fn infrastructure_sets_every_setting_for_every_environment() {
    let root = leasehold_test_support::workspace_root();
    let bicep = std::fs::read_to_string(root.join("deploy/main.bicep")).unwrap();
    let set: Vec<&str> = bicep
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("{ name: '")
                .and_then(|r| r.split('\'').next())
        })
        .collect();
    for setting in settings_read() {
        assert!(
            set.contains(&setting.as_str()),
            "deploy/main.bicep does not set the app setting {setting}"
        );
    }
    assert!(
        set.contains(&"FUNCTIONS_WORKER_RUNTIME") && set.contains(&"APPLICATIONINSIGHTS_CONNECTION_STRING")
    );

    // Parameters: the ones without a default must be given by every environment's file, and a
    // file may only give parameters the template declares.
    let mut declared = Vec::new();
    let mut required = Vec::new();
    for line in bicep.lines() {
        if let Some(rest) = line.strip_prefix("param ") {
            let name = rest.split_whitespace().next().unwrap().to_string();
            if !rest.contains('=') {
                required.push(name.clone());
            }
            declared.push(name);
        }
    }
    for env in ["dev", "test", "prod"] {
        let params = read(&format!("deploy/parameters/{env}.json"));
        let given = params["parameters"].as_object().unwrap();
        for r in &required {
            assert!(
                given.contains_key(r),
                "deploy/parameters/{env}.json lacks the required parameter {r}"
            );
        }
        for g in given.keys() {
            assert!(
                declared.contains(g),
                "deploy/parameters/{env}.json sets {g}, which main.bicep does not declare"
            );
        }
        assert_eq!(given["environmentName"]["value"], env);
    }
}

/// The Kubernetes manifest: the Start key is required (a missing secret must not mean an open
/// endpoint), the pod is locked down, a disruption budget keeps Start up through drains, and the
/// liveness probe has a port of its own (a flood of Start's cannot get the pod restarted).
#[test]
fn the_kubernetes_manifest_requires_the_start_key_and_locks_the_pod_down() {
    let text = std::fs::read_to_string(format!(
        "{}/../../deploy/keda/leasehold.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let key = text
        .lines()
        .skip_while(|l| !l.contains("name: LEASEHOLD_API_KEY"))
        .nth(1)
        .expect("LEASEHOLD_API_KEY comes from a secret");
    assert!(
        key.contains("secretKeyRef") && !key.contains("optional"),
        "the Start key must be required: {key}"
    );
    assert!(!text.contains("AccountKey="), "no account key in the manifest");
    let liveness = text
        .lines()
        .skip_while(|l| !l.contains("livenessProbe:"))
        .nth(1)
        .expect("a liveness probe");
    assert!(
        liveness.contains("port: 7072"),
        "the liveness probe uses the health port: {liveness}"
    );
    for required in [
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
        "drop: [\"ALL\"]",
        "kind: PodDisruptionBudget",
        "type: azure-queue",
        // Workload identity for leasehold and for KEDA, no key.
        "azure.workload.identity/use: \"true\"",
        "name: AzureWebJobsStorage__accountName",
        "provider: azure-workload",
        "{ name: LEASEHOLD_HEALTH_PORT, value: \"7072\" }",
    ] {
        assert!(
            text.contains(required),
            "deploy/keda/leasehold.yaml lacks {required:?}"
        );
    }
}

/// The template offers Flex Consumption (the default, identity only), Elastic Premium (prod) and
/// Linux Consumption (legacy), each with what it needs. Checked as text: Bicep itself cannot be
/// compiled here (see docs/deploying.md for what only Azure can check).
#[test]
fn the_template_offers_flex_premium_and_legacy_consumption_with_identity() {
    let root = leasehold_test_support::workspace_root();
    let bicep = std::fs::read_to_string(root.join("deploy/main.bicep")).unwrap();
    for required in [
        "@allowed(['FC1', 'EP1', 'EP2', 'EP3', 'Y1'])",
        "param planSku string = 'FC1'",
        // Flex: runtime and package in functionAppConfig, package read with the app's identity,
        // no shared keys on the account.
        "runtime: { name: 'custom', version: '1.0' }",
        "authentication: { type: 'SystemAssignedIdentity' }",
        "var allowSharedKey = !isFlex",
        "allowSharedKeyAccess: allowSharedKey",
        // The host and the handler by identity, with the Functions setting names.
        "{ name: 'AzureWebJobsStorage__accountName', value: storage.name }",
        "{ name: 'AzureWebJobsStorage__credential', value: 'managedidentity' }",
        // Premium's content share and run from package.
        "{ name: 'WEBSITE_CONTENTAZUREFILECONNECTIONSTRING', value: storageConnection }",
        "{ name: 'WEBSITE_CONTENTSHARE', value: contentShareName }",
        "{ name: 'WEBSITE_RUN_FROM_PACKAGE', value: '1' }",
        // The identity's roles on the account: blob data owner, queue data contributor.
        "blobDataOwner: 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'",
        "queueDataContributor: '974c5e8b-45b9-4653-ba55-5f855dd0fb88'",
        "principalId: app.identity.principalId",
    ] {
        assert!(bicep.contains(required), "deploy/main.bicep lacks {required:?}");
    }
    // dev and test take the default (FC1); prod runs always-ready on Elastic Premium.
    for env in ["dev", "test"] {
        assert!(read(&format!("deploy/parameters/{env}.json"))["parameters"]["planSku"].is_null());
    }
    assert_eq!(
        read("deploy/parameters/prod.json")["parameters"]["planSku"]["value"],
        "EP1"
    );
}
