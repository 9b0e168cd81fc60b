//! Operating Leasehold against a real Azurite: `status` (the whole system from blob listings),
//! `poison list|show|requeue|purge` (the operations and the command line), the requeue's
//! put-before-delete order under an interruption, and start-up creating what it uses.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::azure::AzureBlobStore;
use leasehold_lock::{LeaseGuard, LeaseLock, LeaseOptions, OpCounters};
use leasehold_ops::{Operator, OverviewQuery, PoisonQuery, PoisonSelection};
use leasehold_runtime::{
    AzureMarkers, AzureQueue, Enqueued, Error, MarkerStore, Peeked, PoisonMessage, Received, RecordId, Scope,
    TriggerKind, TriggerMessage, TriggerQueue, poison_queue_name, record_key,
};
use leasehold_storage::StoreResult;
use leasehold_storage::azure::BlobContainer;
use leasehold_test_support::{Azurite, eventually, unique_name, unless_transient};
use serde_json::Value;

/// One isolated deployment: its own queue and container, on the shared Azurite or (for the
/// tests that scan thousands of entries) on one of their own.
struct Env {
    queue: String,
    container: String,
    azurite: &'static Azurite,
}

impl Env {
    fn new() -> Self {
        Self {
            queue: unique_name("triggers"),
            container: unique_name("locks"),
            azurite: Azurite::shared(),
        }
    }

    /// A deployment on an Azurite of its own, for a test that scans thousands of entries: with
    /// them on the shared one, the other tests' requests went unanswered for a minute (Azurite's
    /// backlog under the scans' hides and renewals), and failed; with the two on one Azurite of
    /// their own they had to take turns (64 s and 43 s, 150 s for the binary; now 65 s). It
    /// exits with this process.
    fn heavy() -> Self {
        Self {
            azurite: Box::leak(Box::new(Azurite::start().expect("an Azurite of its own"))),
            ..Self::new()
        }
    }

    /// What the binary needs to reach this deployment.
    fn storage_vars(&self) -> Vec<(String, String)> {
        vec![
            ("AzureWebJobsStorage".into(), self.azurite.connection_string()),
            ("LEASEHOLD_QUEUE".into(), self.queue.clone()),
            ("LEASEHOLD_CONTAINER".into(), self.container.clone()),
        ]
    }

    fn settings_with(&self, connection: String) -> leasehold::Settings {
        leasehold::Settings::from_vars([
            ("AzureWebJobsStorage", connection),
            ("LEASEHOLD_QUEUE", self.queue.clone()),
            ("LEASEHOLD_CONTAINER", self.container.clone()),
        ])
        .unwrap()
    }

    fn settings(&self) -> leasehold::Settings {
        self.settings_with(self.azurite.connection_string())
    }

    fn operator(&self) -> Operator {
        Operator::new(&self.settings().storage()).unwrap()
    }

    fn poison(&self) -> AzureQueue {
        AzureQueue::new(
            &self.azurite.account(),
            &poison_queue_name(&self.queue),
            OpCounters::new(),
        )
    }

    fn lock(&self, holder: &str) -> LeaseLock {
        let store = AzureBlobStore::new(&self.azurite.account(), &self.container, OpCounters::new());
        // Renewed every second: a hold records its holder at its first renewal.
        let options = LeaseOptions {
            holder: holder.into(),
            renew_every: Duration::from_secs(1),
            ..LeaseOptions::default()
        };
        LeaseLock::new(Arc::new(store), options).unwrap()
    }

    /// The binary (another one with `LEASEHOLD_OPERATE_BIN`, to try a build before a fix) with
    /// this deployment's settings, its output piped.
    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let bin = std::env::var("LEASEHOLD_OPERATE_BIN").unwrap_or_else(|_| common::BIN.to_string());
        let mut command = common::command(bin, args);
        command
            .envs(self.storage_vars())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        command
    }

    /// [`Env::command`] run to its end: its exit code and its stdout and stderr.
    async fn run_status(&self, args: &[&str]) -> (Option<i32>, String) {
        let out = self.command(args).output().await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        (out.status.code(), format!("{stdout}{stderr}"))
    }

    /// Puts `n` poison entries, records r0000.. of scope account, 32 at a time.
    async fn fill_poison(&self, n: usize, reason: &str) {
        use futures::StreamExt;
        let poison = self.poison();
        futures::stream::iter(0..n)
            .for_each_concurrent(32, |i| {
                let poison = &poison;
                async move {
                    let body = entry("account", &format!("r{i:04}"), reason);
                    poison.put(&body, Duration::ZERO).await.unwrap();
                }
            })
            .await;
    }

    /// The binary with this deployment's settings; its stdout, and whether it succeeded.
    async fn run(&self, args: &[&str]) -> (bool, String) {
        let out = common::leasehold(args)
            .envs(self.storage_vars())
            .env("RUST_LOG", "warn")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        (out.status.success(), format!("{stdout}{stderr}"))
    }
}

fn scope(s: &str) -> Scope {
    Scope::parse(s).unwrap()
}

fn record(r: &str) -> RecordId {
    RecordId::parse(r).unwrap()
}

fn trigger(s: &str, r: &str) -> TriggerMessage {
    TriggerMessage::new(scope(s), record(r))
}

/// A poison entry as the worker writes it.
fn entry(s: &str, r: &str, reason: &str) -> String {
    let t = trigger(s, r);
    let error = Error::Logic(leasehold_runtime::LogicError::new(reason));
    PoisonMessage::new(t.encode(), Some(t), &error, 5).encode()
}

async fn hold(lock: &LeaseLock, s: &str, r: &str) -> LeaseGuard {
    lock.try_acquire(&record_key(&scope(s), &record(r)))
        .await
        .unwrap()
        .expect("the record is free")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_every_held_record_from_two_listings() {
    let env = Env::new();
    let operator = env.operator();

    // Nothing yet: no container, no queues; an empty system, not an error.
    let empty = operator.overview(&OverviewQuery::default()).await.unwrap();
    assert_eq!(
        (
            empty.held_count,
            empty.records_seen,
            empty.queue.approximate_messages
        ),
        (0, 0, 0)
    );

    let lock = env.lock("vm-7:4242");
    let mut guards = Vec::new();
    for i in 0..12 {
        guards.push(hold(&lock, "account", &format!("a{i:02}")).await);
    }
    for i in 0..3 {
        guards.push(hold(&lock, "contact", &format!("c{i}")).await);
    }
    // Two records that ran and are free again.
    for r in ["free1", "free2"] {
        hold(&lock, "account", r).await.release().await.unwrap();
    }
    // One broken by an operator (breaking until its period ends), one with a retrigger pending.
    lock.break_lock(&record_key(&scope("account"), &record("a03")), "test")
        .await
        .unwrap();
    let markers = AzureMarkers::new(&Azurite::shared().account(), &env.container, OpCounters::new());
    markers
        .set(&record_key(&scope("account"), &record("a05")))
        .await
        .unwrap();
    let triggers = common::queue(&env.queue);
    triggers
        .put(&trigger("account", "a05").encode(), Duration::ZERO)
        .await
        .unwrap();

    // The holds record their holder once renewed.
    guards[5].renewals().changed().await.unwrap();
    let mut all = operator.overview(&OverviewQuery::default()).await.unwrap();
    for _ in 0..50 {
        let a05 = all.held.iter().find(|h| h.record_id.as_str() == "a05").unwrap();
        if a05.holder.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        all = operator.overview(&OverviewQuery::default()).await.unwrap();
    }
    assert_eq!((all.held_count, all.records_seen), (15, 17));
    // Three listings (one page each), a length and a peek per queue (each lane's trigger and
    // poison queue): no request per record.
    assert_eq!(all.requests, 11, "{all:?}");
    assert_eq!(
        all.low_queue.as_ref().map(|q| q.name.clone()),
        Some(leasehold_runtime::low_queue_name(&env.queue))
    );
    assert_eq!(all.low_poison.as_ref().map(|q| q.approximate_messages), Some(0));
    assert_eq!(all.waiting_count, 0);
    let a03 = all.held.iter().find(|h| h.record_id.as_str() == "a03").unwrap();
    assert_eq!(a03.lease_state, "breaking");
    let a05 = all.held.iter().find(|h| h.record_id.as_str() == "a05").unwrap();
    assert!(a05.retrigger_pending && a05.lease_state == "leased");
    assert_eq!(a05.holder.as_deref(), Some("vm-7:4242"));
    assert!(a05.generation >= 1 && a05.since.is_some() && a05.since_age_seconds.unwrap() < 120.0);
    assert_eq!(all.pending_count, 1);
    assert_eq!(all.queue.approximate_messages, 1);
    assert!(all.queue.oldest_visible_at.is_some());

    // By scope, and page by page.
    let contact = operator
        .overview(&OverviewQuery {
            scope: Some(scope("contact")),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        (contact.held_count, contact.records_seen, contact.pending_count),
        (3, 3, 0)
    );
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = operator
            .overview(&OverviewQuery {
                scope: Some(scope("account")),
                limit: Some(5),
                after: after.clone(),
            })
            .await
            .unwrap();
        assert!(page.held.len() <= 5);
        seen.extend(page.held.iter().map(|h| h.record_id.to_string()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let expected: Vec<String> = (0..12).map(|i| format!("a{i:02}")).collect();
    assert_eq!(seen, expected);

    // Pending retriggers of records not held page with the rest.
    for r in ["p0", "p1", "p2"] {
        markers
            .set(&record_key(&scope("queued"), &record(r)))
            .await
            .unwrap();
    }
    let mut pending = Vec::new();
    let mut after = None;
    loop {
        let page = operator
            .overview(&OverviewQuery {
                scope: Some(scope("queued")),
                limit: Some(2),
                after: after.clone(),
            })
            .await
            .unwrap();
        assert!(page.held.is_empty() && page.pending.len() <= 2 && page.pending_count == 3);
        pending.extend(page.pending.iter().map(|p| p.record_id.to_string()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(pending, ["p0", "p1", "p2"]);
    for r in ["p0", "p1", "p2"] {
        markers
            .take(&record_key(&scope("queued"), &record(r)))
            .await
            .unwrap();
    }

    // The command line: a table with readable times, and JSON with machine values.
    let (ok, text) = env.run(&["status"]).await;
    assert!(ok, "{text}");
    assert!(
        text.contains("15 held, 1 with a retrigger pending, 17 known"),
        "{text}"
    );
    assert!(
        text.contains("HELD RECORD") && text.contains("account/a03  breaking"),
        "{text}"
    );
    assert!(text.contains("vm-7:4242") && text.contains(" s ago"), "{text}");
    let (ok, json) = env.run(&["status", "--json", "--scope", "contact"]).await;
    assert!(ok, "{json}");
    let json: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["heldCount"], 3);
    assert!(
        json["held"][0]["since"].as_str().unwrap().ends_with('Z'),
        "{json}"
    );
    let (ok, one) = env.run(&["status", "--scope", "account", "a05"]).await;
    assert!(ok, "{one}");
    assert!(
        one.contains("retrigger   pending") && one.contains("last fenced grant") && one.contains("ago"),
        "{one}"
    );
    for guard in guards {
        guard.release().await.ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_entries_are_listed_shown_requeued_and_purged() {
    let env = Env::new();
    let poison = env.poison();
    let triggers = common::queue(&env.queue);
    // 36 entries: more than one peek shows. r00..r34 in scope account, and one unreadable.
    for i in 0..35 {
        poison
            .put(
                &entry("account", &format!("r{i:02}"), &format!("failure {i}")),
                Duration::ZERO,
            )
            .await
            .unwrap();
    }
    poison.put("not base64 at all", Duration::ZERO).await.unwrap();
    let operator = env.operator().with_scan_hide(Duration::from_secs(30));

    // A peek: the first 32, oldest first, with no side effect.
    // A queue promises no order, so each entry is checked against its own record.
    let list = operator.poison_list(&PoisonQuery::default()).await.unwrap();
    assert_eq!(list.entries.len(), 32);
    assert!(!list.complete);
    for entry in &list.entries {
        let Some(record) = &entry.record_id else {
            continue; // the unreadable one, if the peek reached it
        };
        let n: u32 = record.as_str()[1..].parse().unwrap();
        assert_eq!(entry.reason, format!("logic failed: failure {n}"), "{entry:?}");
        assert_eq!(entry.attempts, 5, "{entry:?}");
    }
    assert!(list.records.len() >= 31, "{:?}", list.records);
    // A scan: every entry, and all of them visible again afterwards.
    let list = operator
        .poison_list(&PoisonQuery { limit: Some(100) })
        .await
        .unwrap();
    assert_eq!(list.entries.len(), 36);
    assert!(list.complete);
    // A scan puts back what it took batch by batch in the order it took them (32 at once): the
    // oldest 32 are the front still.
    let mut front: Vec<String> = poison
        .peek(32)
        .await
        .unwrap()
        .iter()
        .map(
            |m| match PoisonMessage::decode(&m.body).ok().and_then(|e| e.trigger) {
                Some(trigger) => trigger.record_id.as_str().to_string(),
                None => format!("(unreadable: {})", m.body),
            },
        )
        .collect();
    front.sort();
    let expected: Vec<String> = (0..32).map(|i| format!("r{i:02}")).collect();
    assert_eq!(front, expected, "a scan puts back what it took, in order");

    // Show one beyond the peek's reach.
    let unreadable = list.entries.iter().find(|e| !e.is_trigger).unwrap().clone();
    let shown = operator.poison_show(&unreadable.id).await.unwrap();
    assert_eq!(shown.body.as_deref(), Some("not base64 at all"));
    let missing = operator.poison_show("no-such-id").await.unwrap_err();
    assert_eq!(missing.status(), 404);
    assert!(missing.to_string().contains("poison list"), "{missing}");

    // Requeue one record's entry: a fresh trigger (a new chain), the entry gone.
    let report = operator
        .poison_requeue(
            &PoisonSelection::matching(Some(scope("account")), Some(record("r33"))),
            &|_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.requeued.len(), 1, "{report:?}");
    assert!(report.failed.is_empty() && report.skipped.is_empty());
    let queued = triggers.peek(32).await.unwrap();
    assert_eq!(queued.len(), 1);
    let fresh = TriggerMessage::decode(&queued[0].body).unwrap();
    assert_eq!(
        (
            fresh.record_id.as_str(),
            fresh.kind,
            fresh.prior_attempts,
            fresh.given_up
        ),
        ("r33", TriggerKind::Trigger, 0, 0)
    );
    assert_eq!(poison.approximate_len().await.unwrap(), 35);

    // Requeuing the unreadable one is refused, and said why; purge without --yes is refused.
    let report = operator
        .poison_requeue(&PoisonSelection::ids([unreadable.id.clone()]), &|_| {})
        .await
        .unwrap();
    assert_eq!(report.skipped.len(), 1);
    assert!(report.skipped[0].why.contains("purge it"), "{report:?}");
    let (ok, out) = env.run(&["poison", "purge", &unreadable.id]).await;
    assert!(!ok && out.contains("--yes"), "{out}");
    let (ok, out) = env.run(&["poison", "purge", &unreadable.id, "--yes"]).await;
    assert!(ok && out.contains("purged 1 entry"), "{out}");

    // The command line: list, show, requeue by scope with progress.
    // Which 32 a peek shows after a scan has put entries back is the queue's choice, not ours.
    let (ok, out) = env.run(&["poison", "list"]).await;
    assert!(ok, "{out}");
    let shown = out
        .lines()
        .filter(|line| line.contains("account/r") && line.contains("logic failed: failure "))
        .count();
    assert_eq!(shown, 32, "{out}");
    assert!(
        out.contains("ATTEMPTS") && out.contains("showing the first 32"),
        "{out}"
    );
    // Its stdout only: a loaded machine may have it log a warning on stderr.
    let listed = env
        .command(&["poison", "list", "--limit", "100", "--json"])
        .output()
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let json: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(json["entries"].as_array().unwrap().len(), 34);
    let id = json["entries"][0]["id"].as_str().unwrap().to_string();
    let (ok, out) = env.run(&["poison", "show", &id]).await;
    assert!(
        ok && out.contains("requeue it: leasehold poison requeue"),
        "{out}"
    );
    let (ok, out) = env.run(&["poison", "requeue", "--scope", "account"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("requeued 34 entries as fresh triggers"), "{out}");
    assert_eq!(poison.approximate_len().await.unwrap(), 0);
    assert_eq!(triggers.approximate_len().await.unwrap(), 35);
    let (ok, out) = env.run(&["poison", "requeue"]).await;
    assert!(
        !ok && out.contains("--all"),
        "a requeue must say what it selects: {out}"
    );
}

/// A poison queue whose deletes never answer (and say when one is asked for): the operator
/// "dies" (its future is dropped) between putting the fresh trigger and removing the entry.
#[derive(Debug)]
struct DeleteHangs(AzureQueue, Arc<tokio::sync::Notify>);

#[async_trait]
impl TriggerQueue for DeleteHangs {
    fn name(&self) -> &str {
        self.0.name()
    }
    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
        self.0.put(body, delay).await
    }
    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        self.0.get(max, visibility).await
    }
    async fn delete(&self, _id: &str, _pop_receipt: &str) -> StoreResult<()> {
        self.1.notify_one();
        std::future::pending().await
    }
    async fn set_visibility(&self, id: &str, receipt: &str, body: &str, v: Duration) -> StoreResult<String> {
        self.0.set_visibility(id, receipt, body, v).await
    }
    async fn update_visibility(&self, id: &str, receipt: &str, v: Duration) -> StoreResult<String> {
        self.0.update_visibility(id, receipt, v).await
    }
    async fn approximate_len(&self) -> StoreResult<u64> {
        self.0.approximate_len().await
    }
    async fn peek(&self, max: u32) -> StoreResult<Vec<Peeked>> {
        self.0.peek(max).await
    }
    fn counters(&self) -> &OpCounters {
        self.0.counters()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_interrupted_between_put_and_delete_leaves_the_trigger_in_both_places() {
    let env = Env::new();
    let account = Azurite::shared().account();
    let poison = env.poison();
    poison
        .put(&entry("account", "r1", "boom"), Duration::ZERO)
        .await
        .unwrap();
    let triggers = common::queue(&env.queue);
    let counters = OpCounters::new();
    let deleting = Arc::new(tokio::sync::Notify::new());
    let lock = env.lock("operator");
    let operator = Operator::from_parts(
        Arc::new(common::queue(&env.queue)),
        Arc::new(DeleteHangs(env.poison(), deleting.clone())),
        lock,
        Arc::new(AzureMarkers::new(&account, &env.container, counters.clone())),
        BlobContainer::new(&account, &env.container, counters.clone()),
        counters,
    )
    .with_scan_hide(Duration::from_secs(2));
    // The requeue runs until it asks for its delete (however long a loaded machine takes to get
    // there), and is cut off there, its future dropped: it can never finish, as its delete
    // never answers. (Cut off while a request is in flight, it could leave the shared
    // connection pool a closing connection for the next request of this test.)
    let everything = PoisonSelection::all();
    tokio::select! {
        done = operator.poison_requeue(&everything, &|_| {}) => {
            panic!("the requeue finished though its delete never answers: {done:?}")
        }
        () = deleting.notified() => {}
        () = tokio::time::sleep(Duration::from_secs(60)) => {
            panic!("the requeue did not reach its delete within 60 s")
        }
    }
    // The fresh trigger is on the queue ...
    let queued = triggers.peek(32).await.unwrap();
    assert_eq!(queued.len(), 1);
    assert_eq!(
        TriggerMessage::decode(&queued[0].body)
            .unwrap()
            .record_id
            .as_str(),
        "r1"
    );
    // ... and the entry comes back into view in the poison queue once its hiding ends.
    let back = eventually(
        Duration::from_secs(20),
        "the entry to be visible again",
        || async {
            let peeked = unless_transient(poison.peek(32).await, "peeking at the poison queue")?;
            (!peeked.is_empty()).then_some(peeked)
        },
    )
    .await;
    assert_eq!(
        PoisonMessage::decode(&back[0].body).unwrap().reason(),
        "logic failed: boom"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_creates_the_queues_and_the_container_and_goes_on_without_the_rights() {
    let env = Env::new();
    let account = Azurite::shared().account();
    let app = leasehold::Application::build(
        env.settings(),
        leasehold::Mode::Standalone {
            port: Some(0),
            demo: true,
        },
    )
    .await
    .unwrap();
    assert!(common::queue(&env.queue).exists().await.unwrap());
    assert!(env.poison().exists().await.unwrap());
    let container = BlobContainer::new(&account, &env.container, OpCounters::new());
    assert!(container.container_exists().await.unwrap());
    drop(app);

    // The custom handler too (in the background: GET / is answered at once).
    let env = Env::new();
    let mut settings = env.settings_with(Azurite::shared().connection_string());
    settings.handler_port = Some(0);
    settings.logic = leasehold::LogicSetting::Demo(Duration::from_secs(1));
    let handler = leasehold::Application::build(settings, leasehold::Mode::Handler)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the handler to create its queues",
        || async {
            let queue = unless_transient(common::queue(&env.queue).exists().await, "the queue")?;
            let poison = unless_transient(env.poison().exists().await, "the poison queue")?;
            (queue && poison).then_some(())
        },
    )
    .await;
    drop(handler);

    // Credentials that may touch messages and blobs but not create queues or containers (an
    // account SAS for objects only, as a data-only role): start-up says so and goes on.
    let env = Env::new();
    let settings = env.settings_with(Azurite::shared().sas_connection_string_for("o"));
    let app = leasehold::Application::build(
        settings,
        leasehold::Mode::Standalone {
            port: Some(0),
            demo: true,
        },
    )
    .await;
    assert!(app.is_ok(), "start-up goes on: {:?}", app.err());
    assert!(!common::queue(&env.queue).exists().await.unwrap());
}

/// Measurement, not a check of the product (run it by name): `status` over 10,000 held
/// records. Sets them up with infinite leases and the lock's metadata straight through the SDK
/// (two requests a record), then prints the overview's requests and time.
///
/// `cargo test -p leasehold --test operate -- --ignored --nocapture status_at_scale`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it by name"]
async fn status_at_scale() {
    use futures::StreamExt;
    let records: usize = std::env::var("LEASEHOLD_STATUS_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let env = Env::new();
    let account = Azurite::shared().account();
    let container = BlobContainer::new(&account, &env.container, OpCounters::new());
    container.create().await.unwrap();
    let started = std::time::Instant::now();
    futures::stream::iter(0..records)
        .for_each_concurrent(64, |i| {
            let blob = container.blob(&format!("locks/account/r{i:06}"));
            async move {
                let metadata = [
                    ("leasehold_generation".to_string(), "1".to_string()),
                    ("leasehold_holder".to_string(), "bench:1".to_string()),
                    ("leasehold_since".to_string(), "1795435471000".to_string()),
                ]
                .into_iter()
                .collect();
                let options = azure_storage_blob::models::BlobClientUploadOptions {
                    metadata: Some(metadata),
                    ..Default::default()
                };
                blob.upload(azure_core::Bytes::new().into(), Some(options))
                    .await
                    .unwrap();
                blob.acquire_lease(-1, None).await.unwrap();
            }
        })
        .await;
    eprintln!(
        "set up {records} held records in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let operator = env.operator();
    let started = std::time::Instant::now();
    let overview = operator.overview(&OverviewQuery::default()).await.unwrap();
    let took = started.elapsed();
    assert_eq!(overview.held_count, records);
    let started = std::time::Instant::now();
    let (ok, out) = env.run(&["status"]).await;
    let cli = started.elapsed();
    assert!(ok, "{out}");
    println!(
        "status over {records} held records: {} storage requests ({} blob list pages of 5,000, 4 queue requests), \
         {:.2} s in-process, {:.2} s for `leasehold status` as a process",
        overview.requests,
        records.div_ceil(5000) + 2,
        took.as_secs_f64(),
        cli.as_secs_f64()
    );
}

/// The record of the first visible poison entry (r0000.. are put in order and a scan takes
/// them in order: the front's number is about how many a scan has taken so far).
async fn front_record(poison: &AzureQueue) -> Option<usize> {
    let peeked = poison.peek(1).await.ok()?;
    let trigger = PoisonMessage::decode(&peeked.first()?.body).ok()?.trigger?;
    trigger.record_id.as_str()[1..].parse().ok()
}

/// Starts `leasehold poison list --limit 5000` over the poison queue and waits until it has
/// taken at least `taken` entries (the queue's front has moved past them).
async fn a_scan_under_way(env: &Env, taken: usize) -> tokio::process::Child {
    let child = env
        .command(&["poison", "list", "--limit", "5000", "--json"])
        .spawn()
        .unwrap();
    let poison = env.poison();
    eventually(
        Duration::from_secs(60),
        "the scan to take its entries",
        || async { front_record(&poison).await.filter(|n| *n >= taken) },
    )
    .await;
    child
}

/// How many poison entries are visible now: taken 32 at a time (hidden for 5 minutes, so none
/// comes round twice) until the queue shows none, then put back. Unlike a listing it stops at
/// nothing and holds nothing over.
async fn visible_count(poison: &AzureQueue) -> usize {
    use futures::StreamExt;
    // By id, the latest receipt (Azurite under load may hand out a hidden message again).
    let mut taken = std::collections::HashMap::new();
    loop {
        // A loaded Azurite may time out a request now and then: ask again.
        let Some(batch) = unless_transient(poison.get(32, Duration::from_secs(300)).await, "counting") else {
            continue;
        };
        if batch.is_empty() {
            break;
        }
        taken.extend(batch.into_iter().map(|m| (m.id, m.pop_receipt)));
    }
    futures::stream::iter(&taken)
        .for_each_concurrent(32, |(id, receipt)| async move {
            loop {
                match poison.update_visibility(id, receipt, Duration::ZERO).await {
                    Err(e) if e.is_transient() => continue,
                    // Ok, or taken again since (that take put it back).
                    _ => break,
                }
            }
        })
        .await;
    taken.len()
}

/// A `leasehold poison list` killed (SIGKILL) mid-scan of 2,000 entries: the entries it held
/// are all visible again within its short hiding (30 s, renewed while it ran), counted from
/// 31 s after the kill until every one is visible, at most 75 s after it (before, each was
/// hidden for 2 s per 32 entries from when it was taken: about 120 s after the kill here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_scans_entries_are_visible_again_within_its_short_hiding() {
    let env = Env::heavy();
    env.fill_poison(2000, "boom").await;
    let mut child = a_scan_under_way(&env, 300).await;
    child.start_kill().unwrap();
    let killed = std::time::Instant::now();
    child.wait().await.unwrap();
    tokio::time::sleep(Duration::from_secs(31).saturating_sub(killed.elapsed())).await;
    loop {
        let asked = killed.elapsed();
        let visible = visible_count(&env.poison()).await;
        println!(
            "a killed scan: {visible} of 2000 entries visible {asked:?} after the kill (counted by {:?})",
            killed.elapsed()
        );
        if visible == 2000 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(75),
            "only {visible} of 2000 entries visible {:?} after the kill",
            killed.elapsed()
        );
    }
}

/// A `requeue --all` that cannot see every entry (another reader holds 100 of 300 hidden)
/// requeues what it sees and says it is incomplete, how many are hidden and when to run it
/// again, with exit status 3 (and `"complete": false` in its JSON); run again once they are
/// back, it gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_that_cannot_see_every_entry_says_it_is_incomplete() {
    let env = Env::new();
    env.fill_poison(300, "boom").await;
    let poison = env.poison();
    let mut held = Vec::new();
    while held.len() < 100 {
        let want = (100 - held.len()).min(32) as u32;
        held.extend(poison.get(want, Duration::from_secs(300)).await.unwrap());
    }
    let (code, out) = env.run_status(&["poison", "requeue", "--all"]).await;
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("requeued 200 entries"), "{out}");
    assert!(out.contains("incomplete: 100 hidden, run again after "), "{out}");
    let (code, out) = env
        .run_status(&["poison", "purge", "--all", "--yes", "--json"])
        .await;
    assert_eq!(code, Some(3), "{out}");
    let json: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&json["complete"], &json["hidden"]),
        (&Value::Bool(false), &Value::from(100))
    );
    assert!(json["retryAfter"].is_string(), "{json}");
    // The other reader lets them go: run again, the requeue gets them all.
    for m in held {
        poison
            .update_visibility(&m.id, &m.pop_receipt, Duration::ZERO)
            .await
            .unwrap();
    }
    let (code, out) = env.run_status(&["poison", "requeue", "--all"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("requeued 100 entries") && !out.contains("incomplete"),
        "{out}"
    );
    assert_eq!(common::queue(&env.queue).approximate_len().await.unwrap(), 300);
    assert_eq!(poison.approximate_len().await.unwrap(), 0);
}

/// Ctrl-C (SIGINT) during a scan of 2,000 entries: the command puts back what it held and
/// exits with 130, and every entry is visible again at once (not when the hiding ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_during_a_scan_puts_back_what_it_took() {
    let env = Env::heavy();
    env.fill_poison(2000, "boom").await;
    let child = a_scan_under_way(&env, 300).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let interrupted = std::time::Instant::now();
    let out = child.wait_with_output().await.unwrap();
    let exited = std::time::Instant::now();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted: put back the "), "{stderr}");
    let visible = visible_count(&env.poison()).await;
    println!(
        "Ctrl-C: the command exited {:?} after the signal; {visible} of 2000 visible {:?} after it exited",
        exited - interrupted,
        exited.elapsed()
    );
    assert_eq!(visible, 2000, "all visible at once");
}

/// `--record` without `--scope` is a record of the scope "default", as in every other command,
/// not that record id in every scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_without_a_scope_is_one_of_the_default_scope() {
    let env = Env::new();
    let poison = env.poison();
    for s in ["default", "account"] {
        poison.put(&entry(s, "r1", "boom"), Duration::ZERO).await.unwrap();
    }
    let (code, out) = env.run_status(&["poison", "requeue", "--record", "r1"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("requeued default/r1") && out.contains("requeued 1 entry"),
        "{out}"
    );
    let left = env.operator().poison_list(&PoisonQuery::default()).await.unwrap();
    assert_eq!(left.entries.len(), 1);
    assert_eq!(left.entries[0].scope.as_ref().unwrap().as_str(), "account");
    let (_, help) = env.run_status(&["poison", "requeue", "--help"]).await;
    assert!(help.contains("scope \"default\" without one"), "{help}");
}

/// Issue 35: `requeue --record r1` (of the scope "default") with r1's entries in another scope
/// said "requeued 0 entries" and exited 0. Now it says which scopes hold the record's entries
/// and the command for them, and exits 4; `purge --record` too; and a record with no entry
/// anywhere says that. Nothing is requeued or purged meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_no_entry_in_its_scope_says_where_its_entries_are_and_exits_4() {
    let env = Env::new();
    let poison = env.poison();
    for s in ["account", "account", "contact"] {
        poison.put(&entry(s, "r1", "boom"), Duration::ZERO).await.unwrap();
    }
    let (code, out) = env.run_status(&["poison", "requeue", "--record", "r1"]).await;
    assert_eq!(code, Some(4), "{out}");
    assert!(
        out.contains("requeued 0 entries")
            && out.contains("no entry of the record r1 in the scope default")
            && out.contains("2 in the scope account, 1 in the scope contact"),
        "{out}"
    );
    assert!(
        out.contains("leasehold poison requeue --scope account --record r1")
            && out.contains("leasehold poison requeue --scope contact --record r1"),
        "{out}"
    );
    let (code, out) = env
        .run_status(&["poison", "purge", "--record", "r1", "--yes"])
        .await;
    assert_eq!(code, Some(4), "{out}");
    assert!(
        out.contains("purged 0 entries")
            && out.contains("leasehold poison purge --scope account --record r1 --yes"),
        "{out}"
    );
    let (code, out) = env
        .run_status(&["poison", "requeue", "--record", "r1", "--json"])
        .await;
    assert_eq!(code, Some(4), "{out}");
    let json: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(json["recordNotFound"], Value::Bool(true), "{json}");
    assert_eq!(
        json["otherScopes"],
        serde_json::json!({"account": 2, "contact": 1})
    );
    // No entry anywhere: said, and 4 too.
    let (code, out) = env
        .run_status(&["poison", "requeue", "--scope", "lead", "--record", "r9"])
        .await;
    assert_eq!(code, Some(4), "{out}");
    assert!(
        out.contains("no entry of the record r9 in the scope lead, nor in any other scope"),
        "{out}"
    );
    assert_eq!(poison.approximate_len().await.unwrap(), 3, "nothing purged");
    // With the scope it names: requeued, exit 0, and the rest said.
    let (code, out) = env
        .run_status(&["poison", "requeue", "--scope", "account", "--record", "r1"])
        .await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("requeued 2 entries") && out.contains("the record r1 also has 1 in the scope contact"),
        "{out}"
    );
    // Only those two went on the trigger queue: the requeues above put nothing there.
    assert_eq!(common::queue(&env.queue).approximate_len().await.unwrap(), 2);
    assert_eq!(poison.approximate_len().await.unwrap(), 1);
}

/// Measurement, not a check (run it by name): the memory of `leasehold poison list` scanning N
/// entries (default 3,000) whose reasons are 8 KiB, the most a worker writes: the peak resident
/// set of the process, less that of a listing of 40, per entry. `LEASEHOLD_OPERATE_BIN` measures
/// another build.
///
/// `cargo test -p leasehold --test operate -- --ignored --nocapture poison_scan_memory`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it by name"]
async fn poison_scan_memory() {
    let n: usize = std::env::var("LEASEHOLD_POISON_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let env = Env::new();
    env.fill_poison(n, &"stderr line of a failing logic\n".repeat(8 * 1024 / 31))
        .await;
    // The peak resident set of a listing, sampled until it exits.
    let peak = |limit: usize| {
        let env = &env;
        async move {
            let limit = limit.to_string();
            let mut child = env
                .command(&["poison", "list", "--limit", &limit, "--json"])
                .spawn()
                .unwrap();
            let pid = child.id().unwrap();
            let mut stdout = child.stdout.take().unwrap();
            let drain = tokio::spawn(async move {
                let mut out = Vec::new();
                tokio::io::AsyncReadExt::read_to_end(&mut stdout, &mut out)
                    .await
                    .unwrap();
                out.len()
            });
            let started = std::time::Instant::now();
            let mut hwm_kib = 0u64;
            loop {
                if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    && let Some(line) = status.lines().find(|l| l.starts_with("VmHWM:"))
                {
                    hwm_kib = hwm_kib.max(line.split_whitespace().nth(1).unwrap().parse().unwrap());
                }
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (hwm_kib, drain.await.unwrap(), started.elapsed())
        }
    };
    let (base, _, _) = peak(40).await;
    let (full, json_bytes, took) = peak(n + 100).await;
    println!(
        "poison list over {n} entries (8 KiB reasons): peak {full} KiB, a listing of 40 {base} KiB: \
         {:.1} KiB per entry ({json_bytes} bytes of JSON), {:.1} s",
        (full.saturating_sub(base)) as f64 / n as f64,
        took.as_secs_f64()
    );
}

// ---------------------------------------------------------------------------------------------
// Each record state reached for real (issue 36): `serve` processes against Azurite, the state
// read back with `leasehold status --scope S RECORD --json`, another process.

/// One deployment for the state tests: [`Env`]'s queue and container, a scratch directory for
/// the `serve` logs and the logic's files, and the real binary for every process.
struct Live {
    env: Env,
    dir: std::path::PathBuf,
}

/// A `serve` process: killed when dropped (a failed test), [`Served::stop`] otherwise.
struct Served {
    child: tokio::process::Child,
    port: u16,
    log: std::path::PathBuf,
}

impl Served {
    fn pid(&self) -> u32 {
        self.child.id().unwrap()
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and waits (30 s at most) for it to exit; how long that took.
    async fn stop(mut self) -> Duration {
        let from = std::time::Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("serve did not stop within 30 s of SIGTERM")
            .unwrap();
        assert!(status.success(), "serve exited {status}: {}", self.log());
        from.elapsed()
    }
}

impl Live {
    fn new() -> Self {
        Self {
            env: Env::new(),
            dir: common::scratch_dir("leasehold-operate-states"),
        }
    }

    /// `serve` with this deployment's settings (any free port, polling every second at most),
    /// `extra` last; its log in `<name>.log`. Returns once it answers `/healthz`.
    async fn serve(&self, name: &str, extra: &[(&str, String)]) -> Served {
        let log = self.dir.join(format!("{name}.log"));
        let mut command = common::leasehold(&["serve"]);
        command
            .envs(self.env.storage_vars())
            .env("LEASEHOLD_PORT", "0")
            .env("LEASEHOLD_POLL_MAX_SECONDS", "1")
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in extra {
            command.env(k, v);
        }
        let child = command.spawn().unwrap();
        let port = common::serve_port(&log).await;
        common::answers(&format!("http://127.0.0.1:{port}/healthz"), "serve to answer").await;
        Served { child, port, log }
    }

    /// The binary's command `args` with this deployment's settings: its stdout; it must succeed.
    async fn cli(&self, args: &[&str]) -> String {
        let out = common::leasehold(args)
            .envs(self.env.storage_vars())
            .env("RUST_LOG", "warn")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "leasehold {args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// `leasehold status --scope S RECORD --json`.
    async fn state(&self, scope: &str, record: &str) -> Value {
        let out = self.cli(&["status", "--scope", scope, record, "--json"]).await;
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    /// Polls [`Live::state`] (every 300 ms) until `check` holds, `limit` at most; the state then.
    async fn state_until(
        &self,
        scope: &str,
        record: &str,
        limit: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let state = self.state(scope, record).await;
            if check(&state) {
                return state;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out after {limit:?} waiting for {what}; the state now: {}",
                serde_json::to_string_pretty(&state).unwrap()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// Milliseconds since the Unix epoch of an RFC 3339 time in UTC (`2026-11-23T12:04:31.123Z`).
fn epoch_ms(text: &str) -> i64 {
    let t = text.strip_suffix('Z').expect("an RFC 3339 time in UTC");
    let (date, time) = t.split_once('T').expect("an RFC 3339 time");
    let d: Vec<i64> = date.split('-').map(|p| p.parse().unwrap()).collect();
    let (hms, frac) = match time.split_once('.') {
        Some((hms, frac)) => (hms, frac),
        None => (time, ""),
    };
    let h: Vec<i64> = hms.split(':').map(|p| p.parse().unwrap()).collect();
    let ms = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<3}")[..3].parse::<i64>().unwrap()
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y, m, day) = (if d[1] <= 2 { d[0] - 1 } else { d[0] }, d[1], d[2]);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 86_400 + h[0] * 3600 + h[1] * 60 + h[2]) * 1000) + ms
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Seconds from now to the state's `until` (negative if past); panics without one.
fn until_in(state: &Value) -> f64 {
    let until = state["until"]
        .as_str()
        .unwrap_or_else(|| panic!("no until: {state}"));
    (epoch_ms(until) - now_ms()) as f64 / 1000.0
}

fn reason(state: &Value) -> &str {
    state["reason"].as_str().unwrap_or("")
}

#[test]
fn rfc3339_times_are_read_back() {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(1_795_000_000_123);
    assert_eq!(epoch_ms(&leasehold_ops::clock::rfc3339(at)), 1_795_000_000_123);
    let whole = std::time::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
    assert_eq!(epoch_ms(&leasehold_ops::clock::rfc3339(whole)), 1_795_000_000_000);
}

/// `running` then `idle`, for real: a `serve` process runs a record whose logic waits for a file
/// the test writes. While it runs, `leasehold status` says `running`, naming the holder (this
/// `serve`'s `host:pid`, written at the lease's first renewal) and the run's token, with no
/// `until`; once the file is written and the run ends, `idle`, its last outcome `completed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_is_running_under_its_holder_then_idle_for_real() {
    let started = std::time::Instant::now();
    let live = Live::new();
    let release = live.dir.join("release");
    let serve = live
        .serve(
            "serve",
            &[
                (
                    "LEASEHOLD_LOGIC_COMMAND",
                    format!("while [ ! -e {} ]; do sleep 0.1; done", release.display()),
                ),
                // Renewed every 5 s: the holder's name is written then.
                ("LEASEHOLD_LEASE_SECONDS", "15".to_string()),
            ],
        )
        .await;
    live.cli(&["enqueue", "--scope", "account", "held-1"]).await;
    let pid = format!(":{}", serve.pid());
    let running = live
        .state_until(
            "account",
            "held-1",
            Duration::from_secs(30),
            "running, its holder named",
            |s| s["state"] == "running" && reason(s).contains(&pid),
        )
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&running).unwrap());
    let generation = running["record"]["generation"].as_u64().unwrap();
    assert_eq!(generation, 1, "the first grant: {running}");
    assert!(
        reason(&running).contains("token 1") && reason(&running).starts_with("running on "),
        "{running}"
    );
    assert!(
        running["record"]["holder"]
            .as_str()
            .is_some_and(|h| h.ends_with(&pid)),
        "{running}"
    );
    assert!(running["until"].is_null(), "{running}");
    std::fs::write(&release, "").unwrap();
    let idle = live
        .state_until(
            "account",
            "held-1",
            Duration::from_secs(30),
            "idle after the run, its end in the history",
            |s| s["state"] == "idle" && reason(s).contains("last: completed"),
        )
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&idle).unwrap());
    assert!(
        reason(&idle).contains("last: completed") && reason(&idle).contains("ran "),
        "{idle}"
    );
    assert!(idle["until"].is_null(), "{idle}");
    assert_eq!(idle["record"]["held"], false, "{idle}");
    serve.stop().await;
    println!(
        "[states] running then idle: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// `waiting`, for real: a scope that debounces (quiet period 15 s); a trigger's delivery waits
/// for its burst to end. `leasehold status` says `waiting`, `until` about 15 s after the trigger
/// (when its waiter looks again), and the record has not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debounced_record_is_waiting_until_its_quiet_period_ends_for_real() {
    const QUIET: f64 = 15.0;
    let started = std::time::Instant::now();
    let live = Live::new();
    let ran = live.dir.join("ran");
    let serve = live
        .serve(
            "serve",
            &[
                ("LEASEHOLD_LOGIC_COMMAND", format!("touch {}", ran.display())),
                ("LEASEHOLD_DEBOUNCE_SECONDS", "0,account=15".to_string()),
                ("LEASEHOLD_DEBOUNCE_MAX_SECONDS", "60".to_string()),
            ],
        )
        .await;
    let sent = now_ms();
    live.cli(&["enqueue", "--scope", "account", "burst-1"]).await;
    let waiting = live
        .state_until(
            "account",
            "burst-1",
            Duration::from_secs(20),
            "waiting with an until",
            |s| s["state"] == "waiting" && s["until"].is_string(),
        )
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&waiting).unwrap());
    let looks_again = (epoch_ms(waiting["until"].as_str().unwrap()) - sent) as f64 / 1000.0;
    assert!(
        (QUIET - 1.0..QUIET + 5.0).contains(&looks_again),
        "it looks again {looks_again:.1} s after the trigger (quiet period {QUIET} s): {waiting}"
    );
    assert!(
        reason(&waiting).contains("burst") && reason(&waiting).contains(waiting["until"].as_str().unwrap()),
        "{waiting}"
    );
    assert_eq!(waiting["record"]["waiting"], true, "{waiting}");
    assert!(!ran.exists(), "the record ran before its quiet period ended");
    serve.stop().await;
    println!("[states] waiting: {:.1} s", started.elapsed().as_secs_f64());
}

/// A downstream for the state tests: a record whose id starts with `throttled` is answered 429
/// with `Retry-After: 120` at once; any other call 200 after a second. It notes every call:
/// record and status.
async fn throttling_downstream() -> (Arc<std::sync::Mutex<Vec<(String, u16)>>>, String) {
    let calls: Arc<std::sync::Mutex<Vec<(String, u16)>>> = Default::default();
    let noted = calls.clone();
    let app = axum::Router::new().route(
        "/run",
        axum::routing::post(move |body: axum::Json<Value>| {
            let noted = noted.clone();
            async move {
                let record = body["recordId"].as_str().unwrap_or("").to_string();
                let (status, retry_after) = if record.starts_with("throttled") {
                    (429, "120")
                } else {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    (200, "0")
                };
                noted.lock().unwrap().push((record, status));
                (
                    axum::http::StatusCode::from_u16(status).unwrap(),
                    [(axum::http::header::RETRY_AFTER, retry_after)],
                    "",
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/run", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (calls, url)
}

/// `deferred` and `paused`, for real, across two processes. Process A's run of a record is
/// answered `429 Retry-After: 120`: `leasehold status` says the record is `deferred`, `until`
/// about 120 s on, the reason naming the 429 and its Retry-After; and the throttle pauses the
/// budget `default` (in storage). A is stopped. Process B, which learnt of the pause from
/// storage (at its first trigger of the budget), is handed another record's trigger: it hands it
/// back, and `leasehold status` says that record is `paused`, `until` the pause's end, the
/// reason naming the budget; its history entry is B's, and the downstream never saw the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_record_is_deferred_and_another_process_holds_the_next_for_its_paused_budget() {
    let started = std::time::Instant::now();
    let live = Live::new();
    let (calls, url) = throttling_downstream().await;
    let logic = [("LEASEHOLD_LOGIC_URL", url)];
    let a = live.serve("a", &logic).await;
    live.cli(&["enqueue", "--scope", "account", "throttled-1"]).await;
    let deferred = live
        .state_until(
            "account",
            "throttled-1",
            Duration::from_secs(20),
            "deferred",
            |s| s["state"] == "deferred",
        )
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&deferred).unwrap());
    let left = until_in(&deferred);
    assert!(
        (100.0..=121.0).contains(&left),
        "until {left:.1} s on: {deferred}"
    );
    assert!(
        reason(&deferred).contains("429") && reason(&deferred).contains("Retry-After: 120"),
        "{deferred}"
    );
    assert!(
        reason(&deferred).starts_with("put off by its logic until"),
        "{deferred}"
    );
    // The pause is in storage; A is stopped, so only B takes triggers from now on.
    let mut polls = 0;
    eventually(Duration::from_secs(20), "the budget's pause in storage", || {
        polls += 1;
        let live = &live;
        let first = polls == 1;
        async move {
            if !first {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            let budget = live.cli(&["budget", "status", "default", "--json"]).await;
            budget.contains("\"paused\": true").then_some(())
        }
    })
    .await;
    a.stop().await;

    let b = live.serve("b", &logic).await;
    // B reads the budget's pause from storage when a trigger of the budget first comes (in
    // the background: that trigger may run or meet the pause); it logs what it read.
    live.cli(&["enqueue", "--scope", "account", "warm-1"]).await;
    eventually(
        Duration::from_secs(20),
        "B to read the pause from storage",
        || async {
            b.log()
                .contains("another worker paused this downstream budget")
                .then_some(())
        },
    )
    .await;
    live.cli(&["enqueue", "--scope", "account", "saved-1"]).await;
    let paused = live
        .state_until("account", "saved-1", Duration::from_secs(20), "paused", |s| {
            s["state"] == "paused"
        })
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&paused).unwrap());
    let left = until_in(&paused);
    assert!((60.0..=121.0).contains(&left), "until {left:.1} s on: {paused}");
    assert!(
        reason(&paused).contains("budget default") && reason(&paused).contains("pause"),
        "{paused}"
    );
    let entry = &paused["history"][0];
    assert_eq!(entry["event"], "paused", "{paused}");
    assert!(
        entry["instance"]
            .as_str()
            .is_some_and(|i| i.ends_with(&format!(":{}", b.pid()))),
        "handed back by B: {paused}"
    );
    assert!(
        !calls.lock().unwrap().iter().any(|(r, _)| r == "saved-1"),
        "the downstream saw the record during the pause"
    );
    b.stop().await;
    println!(
        "[states] deferred, then paused in another process: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// `queued`, for real: two triggers put on the low lane with `leasehold enqueue --priority low`
/// while no worker runs. `leasehold status` says the record is `queued`, naming the low lane's
/// queue and the messages in it (2), not the high lane's (empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_nobody_has_taken_is_queued_in_its_lane_for_real() {
    let live = Live::new();
    for record in ["before-1", "bulk-1"] {
        live.cli(&["enqueue", "--scope", "account", "--priority", "low", record])
            .await;
    }
    let low = leasehold_runtime::low_queue_name(&live.env.queue);
    let queued = live
        .state_until("account", "bulk-1", Duration::from_secs(20), "queued", |s| {
            s["state"] == "queued"
        })
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&queued).unwrap());
    assert!(queued["until"].is_null(), "{queued}");
    let why = reason(&queued);
    assert!(
        why.contains("enqueued at")
            && why.contains(&format!("about 2 messages in the low lane's queue {low}")),
        "{queued}"
    );
}

/// `poisoned`, for real: logic that always fails, `LEASEHOLD_MAX_DEQUEUE_COUNT=2`. Once the
/// trigger is given up, `leasehold status` says the record is `poisoned`, the reason with the
/// give-up, the failure (the logic's exit and what it wrote, from the last failed delivery's
/// entry) and where to look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_logic_always_fails_is_poisoned_for_real() {
    let started = std::time::Instant::now();
    let live = Live::new();
    let serve = live
        .serve(
            "serve",
            &[
                (
                    "LEASEHOLD_LOGIC_COMMAND",
                    "echo 'the CRM refused the update' >&2; exit 3".to_string(),
                ),
                ("LEASEHOLD_MAX_DEQUEUE_COUNT", "2".to_string()),
            ],
        )
        .await;
    live.cli(&["enqueue", "--scope", "account", "doomed-1"]).await;
    let poisoned = live
        .state_until("account", "doomed-1", Duration::from_secs(20), "poisoned", |s| {
            s["state"] == "poisoned"
        })
        .await;
    println!("[states] {}", serde_json::to_string_pretty(&poisoned).unwrap());
    let why = reason(&poisoned);
    assert!(
        why.starts_with("given up at")
            && why.contains("gave up after 2 deliveries")
            && why.contains("the last failure: logic failed: the logic command exited with code 3: the CRM refused the update"),
        "{poisoned}"
    );
    assert!(why.contains("leasehold poison list"), "{poisoned}");
    assert!(poisoned["until"].is_null(), "{poisoned}");
    assert!(
        poisoned["poison"]["approximateMessages"].as_u64() >= Some(1),
        "{poisoned}"
    );
    serve.stop().await;
    println!("[states] poisoned: {:.1} s", started.elapsed().as_secs_f64());
}

/// Where the history's Table endpoint points in [`history_storage_unreachable`].
#[derive(Debug, Clone, Copy)]
enum TableTrouble {
    /// A listener that accepts connections and never answers.
    Hangs,
    /// A closed port.
    Refuses,
}

/// The sum of a metric's samples in Prometheus text (0 when absent).
fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Run history storage refusing or hanging under a real `serve` ([`TableTrouble`]): the queue,
/// blobs and Start on Azurite, the Table endpoint elsewhere. Triggers sent to Start run within
/// 3 s each and the queue drains, before and after the history's writes fail (a hung write fails
/// after 10 s); `GET /metrics` counts the failures and the entries dropped; `serve` stops at
/// once. Returns a line for the report.
async fn history_storage_unreachable(trouble: TableTrouble) -> String {
    const KEY: &str = "operate-history-trouble-key";
    let started = std::time::Instant::now();
    let live = Live::new();
    let port = match trouble {
        TableTrouble::Hangs => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((socket, _)) = listener.accept().await {
                    held.push(socket);
                }
            });
            port
        }
        TableTrouble::Refuses => std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port(),
    };
    let connection: Vec<String> = Azurite::shared()
        .connection_string()
        .split(';')
        .filter(|p| !p.is_empty())
        .map(|p| {
            if p.starts_with("TableEndpoint=") {
                format!("TableEndpoint=http://127.0.0.1:{port}/devstoreaccount1")
            } else {
                p.to_string()
            }
        })
        .collect();
    let connection = connection.join(";");
    assert!(connection.contains(&format!("127.0.0.1:{port}")), "{connection}");
    const ADMIN_KEY: &str = "operate-history-trouble-admin-key";
    let runs = live.dir.join("runs.log");
    let serve = live
        .serve(
            "serve",
            &[
                ("AzureWebJobsStorage", connection.clone()),
                ("LEASEHOLD_API_KEY", KEY.to_string()),
                ("LEASEHOLD_ADMIN_KEY", ADMIN_KEY.to_string()),
                (
                    "LEASEHOLD_LOGIC_COMMAND",
                    format!("echo \"$LEASEHOLD_RECORD_ID\" >> {}", runs.display()),
                ),
            ],
        )
        .await;
    let ran = |record: &str| {
        std::fs::read_to_string(&runs)
            .unwrap_or_default()
            .lines()
            .any(|l| l == record)
    };
    let triggers = common::queue(&live.env.queue);
    // One trigger to Start, run within 3 s; then the queue drains.
    let run_one = |record: String| {
        let (serve, triggers) = (&serve, &triggers);
        async move {
            let sent = std::time::Instant::now();
            let (status, answer) = common::post(
                &serve.url("/api/start"),
                &serde_json::json!({"scope": "account", "recordId": record}).to_string(),
                &[("x-functions-key", KEY), ("content-type", "application/json")],
            )
            .await;
            assert_eq!(status, 202, "{answer}");
            eventually(Duration::from_secs(20), "the run", || async {
                ran(&record).then_some(())
            })
            .await;
            let took = sent.elapsed();
            assert!(
                took < Duration::from_secs(3),
                "{trouble:?}: {record} ran {took:?} after it was sent: {}",
                serve.log()
            );
            eventually(Duration::from_secs(20), "the queue to drain", || async {
                (unless_transient(triggers.approximate_len().await, "the queue")? == 0).then_some(())
            })
            .await;
            took
        }
    };
    let mut took = Vec::new();
    for i in 0..3 {
        took.push(run_one(format!("before-{i}")).await);
    }
    let scrape = || async {
        common::get(&serve.url("/metrics"), &[("x-functions-key", KEY)])
            .await
            .text()
            .await
            .unwrap()
    };
    let body = eventually(
        Duration::from_secs(30),
        "the history's failures counted",
        || async {
            let body = scrape().await;
            (metric(&body, "leasehold_history_failures_total") >= 1.0
                && metric(&body, "leasehold_history_dropped_total") >= 1.0)
                .then_some(body)
        },
    )
    .await;
    let failed_after = started.elapsed();
    assert_eq!(
        metric(&body, "leasehold_history_written_total"),
        0.0,
        "{trouble:?}: nothing was written"
    );
    for i in 0..2 {
        took.push(run_one(format!("after-{i}")).await);
    }
    assert_eq!(
        metric(&body, "leasehold_deliveries_total"),
        3.0,
        "{trouble:?}: the three runs before counted: {body}"
    );
    // Issue 44, item 5: an operator's action is done once its trigger is put; its history note
    // and a record's history are waited for a bounded time (1 s, 3 s), not the request's 10 s.
    let mut actions = String::new();
    if matches!(trouble, TableTrouble::Hangs) {
        let timed = |args: &'static [&'static str]| {
            let connection = connection.clone();
            let vars = live.env.storage_vars();
            async move {
                let sent = std::time::Instant::now();
                let out = common::leasehold(args)
                    .envs(vars)
                    .env("AzureWebJobsStorage", connection)
                    .env("RUST_LOG", "warn")
                    .output()
                    .await
                    .unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout).to_string();
                assert!(
                    out.status.success(),
                    "leasehold {args:?}: {stdout}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                (sent.elapsed(), stdout)
            }
        };
        let (enqueued_in, _) = timed(&["enqueue", "--scope", "account", "operator-1"]).await;
        assert!(
            enqueued_in < Duration::from_millis(1500),
            "leasehold enqueue took {enqueued_in:?}"
        );
        let sent = std::time::Instant::now();
        let (status, answer) = common::post(
            &serve.url("/api/admin/records/account/operator-2/enqueue"),
            "",
            &[("x-leasehold-admin-key", ADMIN_KEY)],
        )
        .await;
        let again_in = sent.elapsed();
        assert!(status < 300, "Run it again: {status} {answer}");
        assert!(
            again_in < Duration::from_millis(1500),
            "Run it again took {again_in:?}"
        );
        let (status_in, status) = timed(&["status", "--scope", "account", "operator-1", "--json"]).await;
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        assert!(
            status_in < Duration::from_millis(4500),
            "leasehold status took {status_in:?}"
        );
        assert!(
            status["historyUnavailable"]
                .as_str()
                .is_some_and(|n| n.contains("no answer within 3 s")),
            "{status}"
        );
        actions = format!(
            "; enqueue {:.2} s, Run it again {:.2} s, status {:.2} s ({})",
            enqueued_in.as_secs_f64(),
            again_in.as_secs_f64(),
            status_in.as_secs_f64(),
            status["state"]
        );
    }
    let failures = metric(&scrape().await, "leasehold_history_failures_total");
    let stopped_in = serve.stop().await;
    assert!(
        stopped_in < Duration::from_secs(12),
        "{trouble:?}: serve took {stopped_in:?} to stop"
    );
    let slowest = took.iter().max().unwrap();
    format!(
        "{trouble:?}: 5 runs, slowest {:.2} s from Start to the logic; failures counted {:.1} s in ({failures} by the end); stopped in {:.2} s; test {:.1} s{actions}",
        slowest.as_secs_f64(),
        failed_after.as_secs_f64(),
        stopped_in.as_secs_f64(),
        started.elapsed().as_secs_f64()
    )
}

/// Issue 36: history storage that hangs, or refuses connections, never delays nor fails a run
/// under a real `serve`, and is counted in `GET /metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_storage_that_hangs_or_refuses_never_delays_a_run() {
    let (hangs, refuses) = tokio::join!(
        history_storage_unreachable(TableTrouble::Hangs),
        history_storage_unreachable(TableTrouble::Refuses)
    );
    println!("[history trouble] {hangs}\n[history trouble] {refuses}");
}

/// Issue 44, item 7: command logic gets the run's trace context in `TRACEPARENT` (W3C's
/// environment carrier), under the caller's trace: the trace id Start was given, a span id of
/// the run's own. (Only the URL logic's header was checked; a command run without it went
/// unseen.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_logic_gets_the_runs_traceparent_under_the_callers_trace() {
    const KEY: &str = "operate-traceparent-key";
    let live = Live::new();
    let seen = live.dir.join("traceparent.log");
    let serve = live
        .serve(
            "serve",
            &[
                ("LEASEHOLD_API_KEY", KEY.to_string()),
                (
                    "LEASEHOLD_LOGIC_COMMAND",
                    format!("echo \"$TRACEPARENT\" >> {}", seen.display()),
                ),
            ],
        )
        .await;
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, answer) = common::post(
        &serve.url("/api/start"),
        &serde_json::json!({"scope": "account", "recordId": "traced-1"}).to_string(),
        &[
            ("x-functions-key", KEY),
            ("content-type", "application/json"),
            ("traceparent", caller),
        ],
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    let line = eventually(Duration::from_secs(20), "the logic's TRACEPARENT", || async {
        std::fs::read_to_string(&seen)
            .ok()
            .filter(|s| !s.trim().is_empty())
    })
    .await;
    let traceparent = line.trim();
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent:?}");
    assert_eq!(
        parts[1], "4bf92f3577b34da6a3ce929d0e0e4736",
        "the caller's trace: {traceparent}"
    );
    assert_ne!(
        parts[2], "00f067aa0ba902b7",
        "a span of the run's own: {traceparent}"
    );
    serve.stop().await;
}
