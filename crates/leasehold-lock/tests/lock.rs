//! Lock behaviour, each scenario run twice: against a real Azurite (real time) and against the
//! in-memory store (paused tokio time).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::memory::MemoryStore;
use leasehold_lock::testing::{Effect, FaultyStore, Interceptor};
use leasehold_lock::{
    LeaseDuration, LeaseGuard, LeaseLock, LeaseOptions, LeaseStore, LockInfo, LockKey, Metadata, Op,
    OpCounters, RetryOptions, StoreError, StoreErrorKind, StoreResult, azure::AzureBlobStore,
};
use leasehold_test_support::{Azurite, CountingProxy, unique_name};

fn key(k: &str) -> LockKey {
    LockKey::new(k).unwrap()
}

/// Options for tests: the shortest lease Azure allows, renewed often.
fn fast_options() -> LeaseOptions {
    LeaseOptions {
        duration: LeaseDuration::from_secs(15).unwrap(),
        renew_every: Duration::from_secs(3),
        safety_margin: Duration::from_secs(2),
        holder: "test".into(),
        ..LeaseOptions::default()
    }
}

/// Awaits `run` for at most `limit` (of simulated time where time is paused), and fails there if
/// it has not ended, as the runtime's behaviour tests do: a broken renewal that never tells of a
/// renewal must fail its test, not hang it (with time paused, the renew loop's timers would move
/// the clock on for ever and the test would never return; against Azurite it waited for ever).
async fn within<T>(limit: Duration, what: &str, run: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {limit:?}"))
}

mod scenarios {
    use super::*;

    /// Waits for `guard`'s first renewal and then for `inspect` to show its holder (written just
    /// after): what `inspect` then says.
    async fn recorded_holder(lock: &LeaseLock, k: &LockKey, guard: &LeaseGuard) -> LockInfo {
        guard.renewals().changed().await.unwrap();
        for _ in 0..100 {
            let info = lock.inspect(k).await.unwrap();
            if info.holder.is_some() {
                assert_eq!(info.holder.as_deref(), Some("test"));
                assert!(info.since.is_some());
                return info;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the holder was never recorded after the first renewal");
    }

    /// N tasks contend for one key; an overlap detector sees one holder at a time, and fencing
    /// tokens rise strictly in the order the grants happened.
    pub async fn contention(store: Arc<dyn LeaseStore>, tasks: usize, rounds: usize) -> Vec<u64> {
        let lock = LeaseLock::new(store, fast_options()).unwrap();
        let inside = Arc::new(AtomicUsize::new(0));
        let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        for _ in 0..tasks {
            let (lock, inside, tokens) = (lock.clone(), inside.clone(), tokens.clone());
            handles.push(tokio::spawn(async move {
                for _ in 0..rounds {
                    let guard = lock
                        .acquire(&key("contended"), Duration::from_secs(30))
                        .await
                        .unwrap();
                    let now_inside = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    assert_eq!(now_inside, 1, "two holders of one key at once");
                    tokens.lock().unwrap().push(guard.fencing_token().unwrap());
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            }));
        }
        for h in handles {
            h.await.unwrap();
        }
        let tokens = tokens.lock().unwrap().clone();
        assert_eq!(tokens.len(), tasks * rounds);
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "tokens not strictly increasing: {tokens:?}"
        );
        tokens
    }

    /// What Leasehold wrote on a lock blob before fencing moved to the page blob's sequence
    /// number: the generation (5), its holder, and a note.
    pub fn block_blob_metadata() -> Metadata {
        [
            ("leasehold_generation", "5"),
            ("leasehold_holder", "old:1"),
            ("leasehold_since", "1795435471000"),
            ("leasehold_note_streak", "1:100"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The lock blob of key `contended` is a block blob at generation 5
    /// ([`block_blob_metadata`]). The first grant turns it into a page blob at 5 under its
    /// lease and takes 6; the lease stays with it (nobody else can take the key), the note
    /// comes along, and holders contending for the key afterwards get strictly rising tokens
    /// above 5, the last of them the blob's sequence number.
    pub async fn a_block_lock_blob_moves_to_a_page_blob_and_its_tokens_go_on(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let k = key("contended");
        let blob = leasehold_lock::lock_blob_name(&k);
        assert_eq!(
            store.properties(&blob).await.unwrap().sequence,
            None,
            "a block blob"
        );
        let first = lock.try_acquire(&k).await.unwrap().unwrap();
        assert_eq!(first.fencing_token(), Some(6));
        assert_eq!(store.properties(&blob).await.unwrap().sequence, Some(6));
        assert!(lock.inspect(&k).await.unwrap().held, "the lease stayed");
        assert!(lock.try_acquire(&k).await.unwrap().is_none());
        assert_eq!(first.note("streak").await.unwrap().as_deref(), Some("1:100"));
        first.release().await.unwrap();
        let tokens = contention(store.clone(), 4, 3).await;
        assert!(tokens[0] > 6, "{tokens:?}");
        let info = lock.inspect(&k).await.unwrap();
        assert_eq!(info.generation, *tokens.last().unwrap());
        assert_eq!(info.notes.get("streak").map(String::as_str), Some("1:100"));
    }

    /// A guard keeps its lease well past the lease duration by renewing it.
    pub async fn renewal_keeps_lease(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let other = LeaseLock::new(store, fast_options()).unwrap();
        let guard = lock
            .try_acquire(&key("renewed"))
            .await
            .unwrap()
            .expect("free key");
        tokio::time::sleep(Duration::from_secs(20)).await; // > 15 s lease duration
        assert!(!guard.is_lost(), "renewal should have kept the lease");
        assert!(
            other.try_acquire(&key("renewed")).await.unwrap().is_none(),
            "lease lapsed despite renewal"
        );
        assert!(
            store_counts(&lock, Op::LeaseRenew) >= 5,
            "expected a renewal every 3 s"
        );
        guard.release().await.unwrap();
        assert!(
            other.try_acquire(&key("renewed")).await.unwrap().is_some(),
            "released key should be free"
        );
    }

    /// An operator's break, from another client, fires the holder's lost signal; nobody else
    /// can take the key until the broken holder has released it (its work stopped) or the time
    /// its lease had left has passed. `break_lock_after(.., ZERO)` frees it at once.
    pub async fn break_fires_lost(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let operator = LeaseLock::new(store, fast_options()).unwrap();
        let guard = lock.try_acquire(&key("broken")).await.unwrap().unwrap();
        let lost = guard.lost();
        operator.break_lock(&key("broken"), "test").await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), lost.cancelled())
            .await
            .expect("lost signal within one renewal period after a break");
        assert!(
            operator.try_acquire(&key("broken")).await.unwrap().is_none(),
            "held while breaking"
        );
        // Its own lease id, presented again, is told apart: breaking, neither held nor free.
        match lock.try_acquire_as(&key("broken"), guard.lease_id()).await {
            Err(leasehold_lock::Error::Storage(e)) => {
                assert_eq!(e.kind(), leasehold_lock::StoreErrorKind::LeaseBreaking, "{e}")
            }
            other => panic!("one's own breaking lease is neither held nor free: {other:?}"),
        }
        // The broken holder stops and releases: free at once.
        guard.release().await.unwrap();
        let next = operator
            .try_acquire(&key("broken"))
            .await
            .unwrap()
            .expect("free once the broken holder released");
        assert!(
            lock.try_acquire(&key("broken")).await.unwrap().is_none(),
            "held by the next holder"
        );
        // A break with no period, for a holder known dead, frees the key at once.
        operator
            .break_lock_after(&key("broken"), "holder is dead", Duration::ZERO)
            .await
            .unwrap();
        let after = lock
            .try_acquire(&key("broken"))
            .await
            .unwrap()
            .expect("free at once after a break without period");
        after.release().await.unwrap();
        next.release().await.unwrap();
    }

    /// A second break of a lease that is already breaking can shorten the break (to its own
    /// period), never end it at once: the broken holder is told at its next renewal, and the
    /// key must stay unavailable until then. (Two operators, or one retrying, break twice.)
    pub async fn a_second_break_keeps_the_key_unavailable(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let operator = LeaseLock::new(store, fast_options()).unwrap();
        let k = key("broken-twice");
        let guard = lock.try_acquire(&k).await.unwrap().unwrap();
        operator.break_lock(&k, "first").await.unwrap();
        operator.break_lock(&k, "second").await.unwrap();
        assert!(
            operator.try_acquire(&k).await.unwrap().is_none(),
            "a second break freed the key under its holder"
        );
        tokio::time::timeout(Duration::from_secs(10), guard.lost().cancelled())
            .await
            .expect("lost at the next renewal");
        guard.release().await.unwrap();
        operator
            .try_acquire(&k)
            .await
            .unwrap()
            .expect("free once released");
    }

    /// Notes: a holder writes them under its lease; every later grant reads them (they outlive
    /// the hold and the fencing bump); `inspect` shows them; a holder whose lease is gone cannot
    /// write them any more, so a late write never changes a later holder's notes.
    pub async fn notes_outlive_holds_and_only_the_holder_writes_them(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let k = key("noted");
        let first = lock.try_acquire(&k).await.unwrap().unwrap();
        assert_eq!(first.note("streak").await.unwrap(), None);
        first
            .write_notes(&[("streak", Some("1:2500".into())), ("other", Some("x".into()))])
            .await
            .unwrap();
        assert_eq!(first.note("streak").await.unwrap().as_deref(), Some("1:2500"));
        first.release().await.unwrap();
        let second = lock.try_acquire(&k).await.unwrap().unwrap();
        assert_eq!(second.fencing_token(), Some(2));
        assert_eq!(second.note("streak").await.unwrap().as_deref(), Some("1:2500"));
        second.write_notes(&[("other", None)]).await.unwrap();
        let info = lock.inspect(&k).await.unwrap();
        assert_eq!(info.notes.get("streak").map(String::as_str), Some("1:2500"));
        assert!(!info.notes.contains_key("other"), "{:?}", info.notes);
        assert_eq!(info.generation, 2, "a note write keeps the generation");
        // The lease is broken under the holder and granted to another: the first holder's
        // write, late, is refused.
        lock.break_lock_after(&k, "test", Duration::ZERO).await.unwrap();
        let third = lock.try_acquire(&k).await.unwrap().expect("free after the break");
        assert_eq!(third.note("streak").await.unwrap().as_deref(), Some("1:2500"));
        let refused = second.write_notes(&[("streak", Some("9:9".into()))]).await;
        assert!(
            matches!(refused, Err(leasehold_lock::Error::LeaseLost { .. })),
            "{refused:?}"
        );
        let info = lock.inspect(&k).await.unwrap();
        assert_eq!(info.notes.get("streak").map(String::as_str), Some("1:2500"));
        second.abandon();
        let stale = third;
        stale.release().await.unwrap();
        // Without fencing, notes are read and written the same way.
        let unfenced = LeaseLock::new(
            store,
            LeaseOptions {
                fencing: false,
                ..fast_options()
            },
        )
        .unwrap();
        let g = unfenced.try_acquire(&k).await.unwrap().unwrap();
        assert_eq!(g.note("streak").await.unwrap().as_deref(), Some("1:2500"));
        g.write_notes(&[("streak", None)]).await.unwrap();
        g.release().await.unwrap();
        assert_eq!(unfenced.inspect(&k).await.unwrap().notes, Metadata::new());
        // A shared hold keeps none: its members write the blob only with If-Match.
        let member = unfenced.try_acquire_shared(&k, "s").await.unwrap().unwrap();
        assert!(matches!(
            member.note("streak").await,
            Err(leasehold_lock::Error::Config(_))
        ));
        member.release().await.unwrap();
    }

    /// Fencing tokens rise across release/re-acquire and across takeover after expiry, and a
    /// stale holder can no longer write the lock blob.
    pub async fn fencing_increases(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let k = key("fenced");
        let mut last = 0;
        for _ in 0..3 {
            let g = lock.try_acquire(&k).await.unwrap().unwrap();
            let t = g.fencing_token().unwrap();
            assert!(t > last, "{t} after {last}");
            last = t;
            g.release().await.unwrap();
        }
        // Takeover after expiry: the holder "crashes" (stops renewing, never releases) after
        // its first renewal, which recorded it as the holder.
        let dead = lock.try_acquire(&k).await.unwrap().unwrap();
        let dead_token = dead.fencing_token().unwrap();
        let dead_lease = dead.lease_id();
        assert_eq!(
            lock.inspect(&k).await.unwrap().holder,
            None,
            "recorded only once renewed"
        );
        let recorded = recorded_holder(&lock, &k, &dead).await;
        assert_eq!(recorded.generation, dead_token);
        dead.abandon();
        assert!(
            lock.try_acquire(&k).await.unwrap().is_none(),
            "held until it expires"
        );
        tokio::time::sleep(Duration::from_secs(16)).await;
        let taker = lock.try_acquire(&k).await.unwrap().expect("free after expiry");
        assert!(taker.fencing_token().unwrap() > dead_token);
        let stale_write = store
            .set_metadata("locks/fenced", Some(dead_lease), None, &Metadata::new())
            .await;
        assert_eq!(stale_write.unwrap_err().kind(), StoreErrorKind::LeaseLost);
        let info = lock.inspect(&k).await.unwrap();
        assert!(info.held);
        assert_eq!(info.generation, taker.fencing_token().unwrap());
        assert_eq!(
            (info.holder, info.since),
            (None, None),
            "the dead holder's record is not shown for the new grant"
        );
        let info = recorded_holder(&lock, &k, &taker).await;
        assert_eq!(info.generation, taker.fencing_token().unwrap());
        taker.release().await.unwrap();
        assert!(!lock.inspect(&k).await.unwrap().held);
    }

    /// Sharers with one share key hold together; the key is free only after the last leaves.
    pub async fn shared_holders(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store, fast_options()).unwrap();
        let k = key("shared");
        let a = lock
            .try_acquire_shared(&k, "batch-7")
            .await
            .unwrap()
            .expect("first sharer");
        let b = lock
            .try_acquire_shared(&k, "batch-7")
            .await
            .unwrap()
            .expect("second sharer, same share key");
        assert_eq!(
            a.fencing_token(),
            b.fencing_token(),
            "one shared grant, one token"
        );
        assert!(
            lock.try_acquire(&k).await.unwrap().is_none(),
            "exclusive holder kept out"
        );
        assert!(
            lock.try_acquire_shared(&k, "batch-8").await.unwrap().is_none(),
            "other share key kept out"
        );
        assert_eq!(lock.inspect(&k).await.unwrap().sharers.len(), 2);
        let shared_token = a.fencing_token();
        a.release().await.unwrap();
        assert!(
            lock.try_acquire(&k).await.unwrap().is_none(),
            "one sharer's release freed it under another"
        );
        let c = lock
            .try_acquire_shared(&k, "batch-7")
            .await
            .unwrap()
            .expect("late joiner");
        b.release().await.unwrap();
        assert!(
            lock.try_acquire(&k).await.unwrap().is_none(),
            "still held by the late joiner"
        );
        c.release().await.unwrap();
        let solo = lock
            .try_acquire(&k)
            .await
            .unwrap()
            .expect("free after the last sharer left");
        assert!(solo.fencing_token() > shared_token);
        solo.release().await.unwrap();
    }

    /// All-or-nothing multi-key acquisition leaves nothing held on failure.
    pub async fn multi_key(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store, fast_options()).unwrap();
        let keys = [key("m/c"), key("m/a"), key("m/b")];
        let blocker = lock.try_acquire(&key("m/b")).await.unwrap().unwrap();
        assert!(lock.try_acquire_many(&keys).await.unwrap().is_none());
        for k in [key("m/a"), key("m/c")] {
            let g = lock
                .try_acquire(&k)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{k} left held"));
            g.release().await.unwrap();
        }
        blocker.release().await.unwrap();
        let all = lock.acquire_many(&keys, Duration::from_secs(5)).await.unwrap();
        let names: Vec<_> = all.guards().iter().map(|g| g.key().to_string()).collect();
        assert_eq!(names, ["m/a", "m/b", "m/c"], "canonical order");
        assert!(lock.try_acquire(&key("m/a")).await.unwrap().is_none());
        all.release().await.unwrap();
        assert!(lock.try_acquire_many(&keys).await.unwrap().is_some());
    }

    /// Many tasks use a brand-new key (and container) at once: exactly one wins, none errs.
    pub async fn concurrent_first_use(store: Arc<dyn LeaseStore>) {
        let lock = LeaseLock::new(store, fast_options()).unwrap();
        let barrier = Arc::new(tokio::sync::Barrier::new(16));
        let mut handles = Vec::new();
        for _ in 0..16 {
            let (lock, barrier) = (lock.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                lock.try_acquire(&key("first/use")).await
            }));
        }
        let mut winners = Vec::new();
        for h in handles {
            if let Some(g) = h.await.unwrap().expect("no errors on first use") {
                winners.push(g);
            }
        }
        assert_eq!(winners.len(), 1, "exactly one holder");
        assert_eq!(winners[0].fencing_token(), Some(1));
    }

    /// Round trips per operation once a key exists.
    pub async fn round_trips(store: Arc<dyn LeaseStore>, label: &str) {
        for fencing in [false, true] {
            let lock = LeaseLock::new(
                store.clone(),
                LeaseOptions {
                    fencing,
                    ..fast_options()
                },
            )
            .unwrap();
            let k = key(if fencing { "rt/fenced" } else { "rt/plain" });
            let t0 = store.counters().snapshot();
            lock.try_acquire(&k)
                .await
                .unwrap()
                .unwrap()
                .release()
                .await
                .unwrap();
            let first = store.counters().snapshot().since(&t0);
            let t1 = store.counters().snapshot();
            let guard = lock.try_acquire(&k).await.unwrap().unwrap();
            guard.release().await.unwrap();
            let steady = store.counters().snapshot().since(&t1);
            let holder = lock.try_acquire(&k).await.unwrap().unwrap();
            let t2 = store.counters().snapshot();
            assert!(lock.try_acquire(&k).await.unwrap().is_none());
            let contended = store.counters().snapshot().since(&t2);
            holder.release().await.unwrap();
            println!(
                "[{label}] fencing={fencing}: first use acquire+release: {first}\n\
                 [{label}] fencing={fencing}: acquire+release: {steady}\n\
                 [{label}] fencing={fencing}: failed contended attempt: {contended}"
            );
            // Acquire, the token's increment (fencing), release.
            assert_eq!(steady.total(), if fencing { 3 } else { 2 });
            assert_eq!(contended.total(), 1);
            if fencing {
                // The container exists by now: first use adds the failed acquire (404) and the
                // blob create.
                assert_eq!(first.total(), steady.total() + 2);
            }
        }
    }

    fn store_counts(lock: &LeaseLock, op: Op) -> u64 {
        lock.store().counters().snapshot().get(op)
    }
}

mod azurite {
    use super::*;

    fn store() -> Arc<dyn LeaseStore> {
        let azurite = Azurite::shared();
        Arc::new(AzureBlobStore::new(
            &azurite.account(),
            &unique_name("locks"),
            OpCounters::new(),
        ))
    }

    #[tokio::test]
    async fn a_block_lock_blob_moves_to_a_page_blob_and_its_tokens_go_on() {
        let azurite = Azurite::shared();
        let container = unique_name("locks");
        // Made as earlier versions made lock blobs: an empty block blob, then its metadata.
        let blobs =
            leasehold_storage::azure::BlobContainer::new(&azurite.account(), &container, OpCounters::new());
        let metadata = scenarios::block_blob_metadata().into_iter().collect();
        assert!(
            blobs
                .put_empty_if_absent("locks/contended", Op::BlobCreate)
                .await
                .unwrap()
        );
        blobs
            .set_metadata_if_present("locks/contended", &metadata, Op::BlobSetMetadata)
            .await
            .unwrap()
            .expect("there");
        let store = Arc::new(AzureBlobStore::new(
            &azurite.account(),
            &container,
            OpCounters::new(),
        ));
        scenarios::a_block_lock_blob_moves_to_a_page_blob_and_its_tokens_go_on(store).await;
    }

    /// The account's kind is read as start-up does (Get Account Information): Azurite's holds
    /// page blobs, the lock blobs' kind.
    #[tokio::test]
    async fn the_account_kind_is_read_and_azurites_holds_page_blobs() {
        let azurite = Azurite::shared();
        let blobs = leasehold_storage::azure::BlobContainer::new(
            &azurite.account(),
            &unique_name("kind"),
            OpCounters::new(),
        );
        let kind = blobs.account_kind().await.unwrap().expect("a kind");
        assert!(leasehold_storage::azure::holds_page_blobs(kind), "{kind}");
    }

    /// A connection string with a SAS (no key) works as well as one with the key: every
    /// request carries the signature's parameters.
    #[tokio::test]
    async fn a_sas_connection_string_works() {
        let azurite = Azurite::shared();
        let account =
            leasehold_lock::StorageAccount::from_connection_string(&azurite.sas_connection_string()).unwrap();
        let store = Arc::new(AzureBlobStore::new(
            &account,
            &unique_name("sas"),
            OpCounters::new(),
        ));
        let lock = LeaseLock::new(store, fast_options()).unwrap();
        let guard = lock.try_acquire(&key("sas")).await.unwrap().expect("free");
        assert_eq!(guard.fencing_token(), Some(1));
        guard.release().await.unwrap();

        // And a SAS signed with another key is refused, naming the operation.
        let forged = azurite.sas_connection_string().replace("sig=", "sig=AAAA");
        let account = leasehold_lock::StorageAccount::from_connection_string(&forged).unwrap();
        let store = Arc::new(AzureBlobStore::new(
            &account,
            &unique_name("sas"),
            OpCounters::new(),
        ));
        let lock = LeaseLock::new(store, fast_options()).unwrap();
        let e = lock.try_acquire(&key("sas")).await.unwrap_err().to_string();
        assert!(e.contains("403"), "{e}");
        assert!(!e.contains("sig="), "{e}");
    }

    /// A lock (fencing off: two requests a cycle) whose blob requests go through a proxy that
    /// counts connections, and the counters of its requests.
    fn lock_behind_a_counting_proxy() -> (LeaseLock, CountingProxy, OpCounters) {
        let azurite = Azurite::shared();
        let proxy = CountingProxy::start(azurite.blob_port);
        let account = leasehold_lock::StorageAccount::emulator(
            &azurite.host,
            proxy.port,
            azurite.queue_port,
            azurite.table_port,
        );
        let counters = OpCounters::new();
        let store = Arc::new(AzureBlobStore::new(
            &account,
            &unique_name("pool"),
            counters.clone(),
        ));
        let options = LeaseOptions {
            fencing: false,
            ..fast_options()
        };
        (LeaseLock::new(store, options).unwrap(), proxy, counters)
    }

    /// A store's requests share one connection pool: a few connections carry hundreds of
    /// requests (the legacy SDK this replaced opened a connection per request).
    #[tokio::test]
    async fn connections_are_reused() {
        let (lock, proxy, counters) = lock_behind_a_counting_proxy();
        let k = key("pooled");
        for _ in 0..250 {
            let guard = lock.try_acquire(&k).await.unwrap().expect("free");
            guard.release().await.unwrap();
        }
        let requests = counters.snapshot().total();
        let connections = proxy.connections();
        println!(
            "{requests} requests over {connections} connections ({:.1} connections per 1,000 requests)",
            connections as f64 * 1000.0 / requests as f64
        );
        assert!(requests >= 500, "{requests}");
        assert!(
            connections <= 4,
            "{connections} connections for {requests} requests: connections are not reused"
        );
    }

    /// Each tokio runtime has a pool of its own: a store used from a second runtime opens its
    /// own connection rather than taking one the first runtime serves (whose shutdown would
    /// fail a request handed that connection: "runtime dropped the dispatch task"), and goes
    /// on working once the first runtime is gone.
    #[tokio::test]
    async fn each_runtime_has_a_connection_pool_of_its_own() {
        let (lock, proxy, counters) = lock_behind_a_counting_proxy();
        let cycle = |lock: LeaseLock, name: &'static str| async move {
            let guard = lock.try_acquire(&key(name)).await.unwrap().expect("free");
            guard.release().await.unwrap();
        };
        // Another runtime, alive throughout the first part: its idle connection is there to take.
        let other = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let handle = other.handle().clone();
        handle.spawn(cycle(lock.clone(), "other")).await.unwrap();
        let opened_by_other = proxy.connections();
        assert!(opened_by_other >= 1);
        cycle(lock.clone(), "this").await;
        assert!(
            proxy.connections() > opened_by_other,
            "this runtime took a connection the other runtime serves"
        );
        tokio::task::spawn_blocking(move || drop(other)).await.unwrap();
        // Each cycle on an existing lock blob is an acquire and a release; a failed request
        // would be retried and show.
        cycle(lock.clone(), "after").await;
        let before = counters.snapshot();
        for _ in 0..20 {
            cycle(lock.clone(), "after").await;
        }
        assert_eq!(
            counters.snapshot().since(&before).total(),
            40,
            "no request failed"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn contention() {
        scenarios::contention(store(), 8, 5).await;
    }

    #[tokio::test]
    async fn renewal_keeps_lease() {
        scenarios::renewal_keeps_lease(store()).await;
    }

    #[tokio::test]
    async fn break_fires_lost() {
        scenarios::break_fires_lost(store()).await;
    }

    /// About 25 s (a 16 s expiry and two renewals of 3 s): bounded at 120 s for a loaded
    /// machine.
    #[tokio::test]
    async fn fencing_increases() {
        within(
            Duration::from_secs(120),
            "fencing_increases (azurite)",
            scenarios::fencing_increases(store()),
        )
        .await;
    }

    #[tokio::test]
    async fn notes_outlive_holds_and_only_the_holder_writes_them() {
        scenarios::notes_outlive_holds_and_only_the_holder_writes_them(store()).await;
    }

    #[tokio::test]
    async fn a_second_break_keeps_the_key_unavailable() {
        scenarios::a_second_break_keeps_the_key_unavailable(store()).await;
    }

    #[tokio::test]
    async fn shared_holders() {
        scenarios::shared_holders(store()).await;
    }

    #[tokio::test]
    async fn multi_key() {
        scenarios::multi_key(store()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_first_use() {
        scenarios::concurrent_first_use(store()).await;
    }

    #[tokio::test]
    async fn round_trips() {
        scenarios::round_trips(store(), "azurite").await;
    }

    /// A SAS connection string pointing nowhere: the error is transient (retried, then
    /// surfaced) and its text carries no signature.
    #[tokio::test]
    async fn errors_carry_no_secrets() {
        let account = leasehold_lock::StorageAccount::from_connection_string(
            "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;QueueEndpoint=http://127.0.0.1:9/devstoreaccount1;\
             SharedAccessSignature=sv=2022-11-02&ss=b&srt=sco&sp=rwdlac&se=2030-01-01T00:00:00Z&sig=TOPSECRETSIG",
        )
        .unwrap();
        let store = Arc::new(AzureBlobStore::new(&account, "locks", OpCounters::new()));
        let options = LeaseOptions {
            retry: RetryOptions {
                retries: 1,
                ..RetryOptions::default()
            },
            ..fast_options()
        };
        let lock = LeaseLock::new(store.clone(), options).unwrap();
        let err = lock.try_acquire(&key("x")).await.unwrap_err();
        let text = format!("{err} {err:?}");
        assert!(!text.contains("TOPSECRETSIG"), "{text}");
        match err {
            leasehold_lock::Error::Storage(e) => assert!(e.is_transient(), "{e}"),
            other => panic!("expected a storage error, got {other}"),
        }
        assert_eq!(
            store.counters().snapshot().get(Op::LeaseAcquire),
            2,
            "one retry of a transient failure"
        );
    }
}

mod memory {
    use super::*;

    fn store() -> Arc<dyn LeaseStore> {
        Arc::new(MemoryStore::new())
    }

    #[tokio::test(start_paused = true)]
    async fn a_block_lock_blob_moves_to_a_page_blob_and_its_tokens_go_on() {
        let store = MemoryStore::new();
        store.put_block_blob("locks/contended", scenarios::block_blob_metadata());
        scenarios::a_block_lock_blob_moves_to_a_page_blob_and_its_tokens_go_on(Arc::new(store)).await;
    }

    /// The move's write lands but its answer is lost: the retry finds the blob moved (the ETag
    /// it wrote under changed) and goes on from there. An increment whose answer is lost is
    /// sent again and skips a number: the token never goes back.
    #[tokio::test(start_paused = true)]
    async fn a_move_or_increment_whose_answer_was_lost_goes_on() {
        for (op, block_blob, token) in [(Op::BlobCreate, true, 6), (Op::BlobSequenceIncrement, false, 2)] {
            let inner = Arc::new(MemoryStore::new());
            if block_blob {
                inner.put_block_blob("locks/lost", scenarios::block_blob_metadata());
            }
            let lose = Arc::new(LoseAnswer::of(op));
            let lock = LeaseLock::new(
                Arc::new(FaultyStore::new(inner.clone(), lose.clone())),
                fast_options(),
            )
            .unwrap();
            let guard = lock.try_acquire(&key("lost")).await.unwrap().unwrap();
            assert_eq!(lose.lost.load(Ordering::SeqCst), 1, "{op}: an answer was lost");
            assert_eq!(guard.fencing_token(), Some(token), "{op}");
            assert_eq!(
                inner.properties("locks/lost").await.unwrap().sequence,
                Some(token)
            );
            guard.release().await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn contention() {
        scenarios::contention(store(), 8, 20).await;
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_keeps_lease() {
        scenarios::renewal_keeps_lease(store()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn break_fires_lost() {
        scenarios::break_fires_lost(store()).await;
    }

    /// About 25 s of simulated time: bounded at 60 s of it.
    #[tokio::test(start_paused = true)]
    async fn fencing_increases() {
        within(
            Duration::from_secs(60),
            "fencing_increases (memory)",
            scenarios::fencing_increases(store()),
        )
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn notes_outlive_holds_and_only_the_holder_writes_them() {
        scenarios::notes_outlive_holds_and_only_the_holder_writes_them(store()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_break_keeps_the_key_unavailable() {
        scenarios::a_second_break_keeps_the_key_unavailable(store()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn shared_holders() {
        scenarios::shared_holders(store()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn multi_key() {
        scenarios::multi_key(store()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_first_use() {
        scenarios::concurrent_first_use(store()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn round_trips() {
        scenarios::round_trips(store(), "memory").await;
    }

    /// Renewals that keep failing transiently: the lost signal fires by the local deadline,
    /// before storage could let the lease expire.
    /// Options: the scaled constructor, and validation that refuses what Azure would.
    #[test]
    fn options_scale_with_the_duration_and_bad_ones_are_refused() {
        let o = LeaseOptions::with_duration(LeaseDuration::from_secs(15).unwrap());
        assert_eq!(
            (o.duration.as_duration(), o.renew_every, o.safety_margin),
            (
                Duration::from_secs(15),
                Duration::from_secs(5),
                Duration::from_secs(5)
            )
        );
        assert!(o.validate().is_ok());
        for bad in [
            LeaseOptions {
                renew_every: Duration::ZERO,
                ..LeaseOptions::default()
            },
            LeaseOptions {
                safety_margin: Duration::from_secs(20),
                ..LeaseOptions::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
            assert!(LeaseLock::new(store(), bad).is_err());
        }
    }

    /// `inspect` of a key never used, and of a fenced grant: who holds it and since when.
    #[tokio::test(start_paused = true)]
    async fn inspect_tells_holder_since_and_generation() {
        let lock = LeaseLock::new(store(), LeaseOptions::default()).unwrap();
        let never = lock.inspect(&key("never")).await.unwrap();
        assert_eq!((never.held, never.state, never.generation), (false, None, 0));
        let before = std::time::SystemTime::now() - Duration::from_secs(60);
        let guard = lock.try_acquire(&key("seen")).await.unwrap().unwrap();
        let info = lock.inspect(&key("seen")).await.unwrap();
        assert!(info.held);
        assert_eq!(info.generation, 1);
        assert_eq!(info.holder, None, "recorded once the lease has been renewed");
        tokio::time::sleep(LeaseOptions::default().renew_every + Duration::from_secs(1)).await;
        let info = lock.inspect(&key("seen")).await.unwrap();
        assert_eq!(info.generation, 1);
        let holder = info.holder.unwrap();
        assert!(holder.ends_with(&format!(":{}", std::process::id())), "{holder}");
        assert!(info.since.unwrap() > before);
        guard.release().await.unwrap();
    }

    /// `abandon` stops renewing without releasing (the lease lapses, as a crashed process's);
    /// dropping a guard releases it in the background.
    #[tokio::test(start_paused = true)]
    async fn abandon_lets_the_lease_lapse_and_drop_releases() {
        let lock = LeaseLock::new(store(), fast_options()).unwrap();
        lock.try_acquire(&key("abandoned"))
            .await
            .unwrap()
            .unwrap()
            .abandon();
        assert!(
            lock.try_acquire(&key("abandoned")).await.unwrap().is_none(),
            "not released"
        );
        tokio::time::sleep(fast_options().duration.as_duration() + Duration::from_secs(1)).await;
        assert!(
            lock.try_acquire(&key("abandoned")).await.unwrap().is_some(),
            "lapsed"
        );
        drop(lock.try_acquire(&key("dropped")).await.unwrap().unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            lock.try_acquire(&key("dropped")).await.unwrap().is_some(),
            "released on drop, long before it could lapse"
        );
    }

    /// A released guard renews no more; a lost one says so through `is_lost` too.
    #[tokio::test(start_paused = true)]
    async fn a_released_guard_stops_renewing_and_a_lost_one_says_so() {
        let store = store();
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let guard = lock.try_acquire(&key("quiet")).await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!guard.is_lost());
        guard.release().await.unwrap();
        let after = store.counters().snapshot();
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(store.counters().snapshot().since(&after).get(Op::LeaseRenew), 0);

        let guard = lock.try_acquire(&key("quiet")).await.unwrap().unwrap();
        lock.break_lock_after(&key("quiet"), "test", Duration::ZERO)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), guard.lost().cancelled())
            .await
            .expect("lost at the next renewal");
        assert!(guard.is_lost());
    }

    /// Shared holders write who holds the key and since when, as exclusive ones do.
    #[tokio::test(start_paused = true)]
    async fn shared_holders_are_described_for_operators() {
        let lock = LeaseLock::new(store(), LeaseOptions::default()).unwrap();
        let before = std::time::SystemTime::now() - Duration::from_secs(60);
        let k = key("shared-info");
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        let info = lock.inspect(&k).await.unwrap();
        assert!(info.held);
        let holder = info.holder.expect("holder written");
        assert!(holder.ends_with(&format!(":{}", std::process::id())), "{holder}");
        assert!(info.since.expect("since written") > before);
        member.release().await.unwrap();

        // The lock's own options: its holder name, and no token without fencing.
        let lock = LeaseLock::new(
            store(),
            LeaseOptions {
                holder: "batch-runner".into(),
                fencing: false,
                ..LeaseOptions::default()
            },
        )
        .unwrap();
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        assert_eq!(member.fencing_token(), None);
        let info = lock.inspect(&k).await.unwrap();
        assert_eq!(info.holder.as_deref(), Some("batch-runner"));
        assert_eq!(info.generation, 0);
        member.release().await.unwrap();
    }

    /// A multi-key hold fires its lost signal when any of its leases is lost.
    #[tokio::test(start_paused = true)]
    async fn a_multi_key_hold_is_lost_when_one_lease_is() {
        let store = store();
        let lock = LeaseLock::new(store.clone(), fast_options()).unwrap();
        let all = lock
            .try_acquire_many(&[key("x/a"), key("x/b")])
            .await
            .unwrap()
            .unwrap();
        let lost = all.lost();
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(!lost.is_cancelled(), "both leases renewed: not lost");
        lock.break_lock_after(&key("x/b"), "test", Duration::ZERO)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), lost.cancelled())
            .await
            .expect("lost within a renewal interval");
        all.release().await.unwrap();
    }

    /// A multi-key hold dropped without `release` leaves no task behind: its watcher (which
    /// fires the combined lost signal) ends with it, as do the guards' renewers and the
    /// releases their drops hand to the runtime.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_multi_key_hold_leaves_no_task_behind() {
        let lock = LeaseLock::new(store(), fast_options()).unwrap();
        let keys = [key("leak/a"), key("leak/b")];
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let all = lock.try_acquire_many(&keys).await.unwrap().unwrap();
        assert_eq!(
            metrics.num_alive_tasks(),
            before + 5,
            "two renewers, two holder recorders and a watcher"
        );
        let lost = all.lost();
        drop(all);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(metrics.num_alive_tasks(), before, "a task outlived the hold");
        assert!(!lost.is_cancelled(), "dropped, not lost");
        let again = lock.try_acquire_many(&keys).await.unwrap();
        assert!(again.is_some(), "released on drop");
        again.unwrap().release().await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(metrics.num_alive_tasks(), before, "a task outlived the release");
    }

    /// A shared member that dies without leaving stays in the member list, so the last live
    /// member's leave does not release the key; it is harmless beyond a delay: nobody renews the
    /// lease any more, and the key is free within one lease duration.
    #[tokio::test(start_paused = true)]
    async fn a_dead_shared_member_delays_the_key_by_at_most_a_lease() {
        let lock = LeaseLock::new(store(), fast_options()).unwrap();
        let k = key("shared-dead");
        let live = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        let dead = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        dead.abandon();
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(lock.inspect(&k).await.unwrap().held, "the live member keeps it");
        live.release().await.unwrap();
        let left = tokio::time::Instant::now();
        assert!(
            lock.inspect(&k).await.unwrap().held,
            "the dead member is still listed"
        );
        let other = eventually_free(&lock, &k).await;
        assert!(
            left.elapsed() <= fast_options().duration.as_duration(),
            "free after {:?}",
            left.elapsed()
        );
        other.release().await.unwrap();
    }

    /// A shared session's fencing token is never handed out again once another grant came after
    /// it. The sequence this pins (item 5 of the review; seen as "shared token 1, exclusive
    /// token 2, joiner token 2"):
    ///
    /// 1. member `a` founds a shared session of group G ("batch"): token 1, and the lock blob's
    ///    metadata says group G, members `[a]`;
    /// 2. `a` dies (stops renewing, never leaves): the lease lapses, the metadata still says
    ///    group G, members `[a]`;
    /// 3. exclusive holder E acquires: its fencing increment makes token 2, and the stale
    ///    group and member list stay;
    /// 4. joiner J of group G reads the blob while E holds it: "held, group G, members `[a]`";
    /// 5. E's lease ends (released, or lapsed after E died);
    /// 6. J acquires G (free now) and, trusting the list it read, joins "the session" instead of
    ///    founding one: it kept the generation it read, E's token 2.
    ///
    /// Fencing must rise across every kind of grant: J's token is above E's.
    #[tokio::test(start_paused = true)]
    async fn a_joiner_never_reuses_the_token_of_an_exclusive_grant() {
        for e_ends_by_lapse in [false, true] {
            let inner = Arc::new(MemoryStore::new());
            let lock = LeaseLock::new(inner.clone(), fast_options()).unwrap();
            let gate = Arc::new(ReadGate::default());
            let joiner = LeaseLock::new(
                Arc::new(FaultyStore::new(inner.clone(), gate.clone())),
                fast_options(),
            )
            .unwrap();
            let k = key("shared-then-exclusive");
            let a = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
            assert_eq!(a.fencing_token(), Some(1));
            a.abandon();
            tokio::time::sleep(Duration::from_secs(16)).await;
            let e = lock.try_acquire(&k).await.unwrap().expect("free after the lapse");
            assert_eq!(e.fencing_token(), Some(2));

            gate.arm();
            let j = tokio::spawn({
                let k = k.clone();
                async move { joiner.try_acquire_shared(&k, "batch").await }
            });
            gate.wait_read().await; // J has read the blob while E holds it
            if e_ends_by_lapse {
                e.abandon();
                tokio::time::sleep(Duration::from_secs(16)).await;
            } else {
                e.release().await.unwrap();
            }
            gate.open();
            let j = j.await.unwrap().unwrap().expect("free once E's lease ended");
            assert!(
                j.fencing_token() > Some(2),
                "E ended by {}: shared token 1, exclusive token 2, joiner token {:?}",
                if e_ends_by_lapse { "lapse" } else { "release" },
                j.fencing_token()
            );
            // E's grant left the lapsed session's metadata behind (it writes nothing but the
            // token), and J, having read it while E held, carries the dead member along — the
            // cost of a member that dies without leaving, as always: the key stays held after
            // J leaves, until the lease lapses.
            assert_eq!(lock.inspect(&k).await.unwrap().sharers.len(), 2);
            j.release().await.unwrap();
            let left = tokio::time::Instant::now();
            let free = loop {
                if let Some(g) = lock.try_acquire(&k).await.unwrap() {
                    break g;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            };
            assert!(left.elapsed() <= fast_options().duration.as_duration());
            free.release().await.unwrap();
        }
    }

    /// A joiner inherits a session's token only from the session's own lease, never from a
    /// lease taken afresh (found by review; older than the page blob):
    ///
    /// 1. member `a` founds a session of group G: token 1; `a` dies and its lease lapses;
    /// 2. exclusive holder X acquires, and its increment never lands (X has no token);
    /// 3. joiner J reads the blob while X holds: held, group G, members `[a]`, the session's
    ///    generation still the blob's (1), so the session looks live;
    /// 4. X gives up its grant and releases (nothing written, the ETag unchanged);
    /// 5. J takes G: with an acquire it would get the key afresh and join "the session" with
    ///    token 1, the token of a lapsed session a paused member may still use.
    ///
    /// J renews G instead, which storage refuses once another lease came in between: J founds
    /// a session of its own with token 2.
    #[tokio::test(start_paused = true)]
    async fn a_joiner_inherits_a_token_only_from_the_sessions_own_lease() {
        let inner = Arc::new(MemoryStore::new());
        let lock = LeaseLock::new(inner.clone(), fast_options()).unwrap();
        let gate = Arc::new(ReadGate::default());
        let joiner = LeaseLock::new(
            Arc::new(FaultyStore::new(inner.clone(), gate.clone())),
            fast_options(),
        )
        .unwrap();
        let k = key("shared-lapsed-then-x");
        let blob = leasehold_lock::lock_blob_name(&k);
        let a = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        assert_eq!(a.fencing_token(), Some(1));
        a.abandon();
        tokio::time::sleep(Duration::from_secs(16)).await;
        let x = leasehold_lock::LeaseId::random();
        inner
            .acquire_lease(&blob, x, fast_options().duration)
            .await
            .unwrap();
        gate.arm();
        let j = tokio::spawn({
            let k = k.clone();
            async move { joiner.try_acquire_shared(&k, "batch").await }
        });
        gate.wait_read().await;
        inner.release_lease(&blob, x, None).await.unwrap();
        gate.open();
        let j = j.await.unwrap().unwrap().expect("free once X released");
        assert_eq!(j.fencing_token(), Some(2), "a session of its own");
        assert_eq!(
            lock.inspect(&k).await.unwrap().sharers.len(),
            1,
            "the lapsed member is not carried"
        );
        j.release().await.unwrap();
        // A live session is still joined: its lease renews.
        let first = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        let second = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        assert_eq!(first.fencing_token(), Some(3));
        assert_eq!(second.fencing_token(), Some(3));
        second.release().await.unwrap();
        first.release().await.unwrap();
    }

    /// A lock blob made before fencing moved to the sequence number (a block blob whose
    /// metadata holds the generation) with a shared session's metadata on it whose generation
    /// moved on (an exclusive grant of that older version that left the group's metadata in
    /// place, the worst case): a joiner of the group finds the session over, turns the blob into
    /// a page blob at its generation under the group's lease, and founds a session with the
    /// next token; the next member joins that session.
    #[tokio::test(start_paused = true)]
    async fn a_joiner_on_a_block_lock_blob_moves_it_and_takes_the_next_token() {
        let inner = Arc::new(MemoryStore::new());
        let lock = LeaseLock::new(inner.clone(), fast_options()).unwrap();
        let k = key("shared-on-a-block-blob");
        let blob = leasehold_lock::lock_blob_name(&k);
        let group = leasehold_lock::LeaseId::derived(&[k.as_str(), "batch"]);
        let md: Metadata = [
            ("leasehold_generation", "2"),
            ("leasehold_share_generation", "1"),
            ("leasehold_sharers", "deadmember"),
            ("leasehold_share_group", &group.to_string()),
            ("leasehold_note_streak", "1:100"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        inner.put_block_blob(&blob, md);
        assert_eq!(inner.properties(&blob).await.unwrap().sequence, None);
        let j = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        assert_eq!(j.fencing_token(), Some(3), "the block blob's generation was 2");
        let props = inner.properties(&blob).await.unwrap();
        assert_eq!(props.sequence, Some(3), "now a page blob");
        assert_eq!(
            props.metadata.get("leasehold_note_streak").map(String::as_str),
            Some("1:100"),
            "the notes came along"
        );
        let m = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        assert_eq!(m.fencing_token(), Some(3), "members share the session's token");
        m.release().await.unwrap();
        j.release().await.unwrap();
        let e = lock.try_acquire(&k).await.unwrap().expect("free once both left");
        assert_eq!(e.fencing_token(), Some(4));
        e.release().await.unwrap();
    }

    /// A join whose write took effect but whose answer was lost lists its member once: the
    /// retry finds the blob changed (by that very write), reads it again and finds itself
    /// listed. Listed twice, its one leave would leave it listed, and the key would stay held
    /// until the lease lapsed.
    #[tokio::test(start_paused = true)]
    async fn a_join_whose_answer_was_lost_lists_its_member_once() {
        let inner = Arc::new(MemoryStore::new());
        let lose = Arc::new(LoseAnswer::of(Op::BlobSetMetadata));
        let lock = LeaseLock::new(
            Arc::new(FaultyStore::new(inner.clone(), lose.clone())),
            fast_options(),
        )
        .unwrap();
        let k = key("shared-lost-answer");
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        assert_eq!(
            lose.lost.load(Ordering::SeqCst),
            1,
            "the join's write lost its answer"
        );
        assert_eq!(member.fencing_token(), Some(1));
        assert_eq!(lock.inspect(&k).await.unwrap().sharers.len(), 1);
        member.release().await.unwrap();
        assert!(
            lock.try_acquire(&k).await.unwrap().is_some(),
            "free once its only member left"
        );
    }

    /// Takes `k` as soon as it is free; fails after 5 minutes (of paused time).
    async fn eventually_free(lock: &LeaseLock, k: &LockKey) -> leasehold_lock::LeaseGuard {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(g) = lock.try_acquire(k).await.unwrap() {
                return g;
            }
            assert!(tokio::time::Instant::now() < deadline, "{k} never became free");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lost_when_renewals_keep_failing() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky {
            fail_renewals: true.into(),
            ..Flaky::over(inner.clone())
        });
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let start = tokio::time::Instant::now();
        let guard = lock.try_acquire(&key("flaky")).await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_secs(60), guard.lost().cancelled())
            .await
            .expect("lost within the lease");
        let after = start.elapsed();
        // duration 15 s − margin 2 s = 13 s from the grant.
        assert_eq!(after, Duration::from_secs(13), "lost at the local deadline");
        // Storage still thinks the lease is held for 2 s more: the margin protects the holder.
        let other = LeaseLock::new(inner, fast_options()).unwrap();
        assert!(other.try_acquire(&key("flaky")).await.unwrap().is_none());
    }

    /// A release that keeps failing is reported, not taken for "already gone": the caller
    /// (the runner) must not act as if the key were free. One that recovers within the retries
    /// succeeds.
    #[tokio::test(start_paused = true)]
    async fn a_release_that_keeps_failing_is_an_error() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky {
            fail_releases: 100.into(),
            ..Flaky::over(inner.clone())
        });
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let guard = lock.try_acquire(&key("sticky")).await.unwrap().unwrap();
        let err = guard.release().await.unwrap_err();
        assert!(err.to_string().contains("lease release"), "{err}");
        let other = LeaseLock::new(inner.clone(), fast_options()).unwrap();
        assert!(
            other.try_acquire(&key("sticky")).await.unwrap().is_none(),
            "still held"
        );
        flaky.fail_releases.store(2, Ordering::SeqCst);
        tokio::time::sleep(fast_options().duration.as_duration()).await;
        let guard = lock.try_acquire(&key("sticky")).await.unwrap().unwrap();
        guard.release().await.unwrap();
        assert!(
            other.try_acquire(&key("sticky")).await.unwrap().is_some(),
            "released"
        );
    }

    /// Transient failures are retried with backoff; definitive ones are not.
    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky {
            fail_acquires: 2.into(),
            ..Flaky::over(inner.clone())
        });
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let guard = lock
            .try_acquire(&key("retry"))
            .await
            .unwrap()
            .expect("acquired after two transient failures");
        // 1 (not found) + create + 2 failed + 1 ok acquires.
        assert_eq!(inner.counters().snapshot().get(Op::LeaseAcquire), 2);
        assert_eq!(flaky.fail_acquires.load(Ordering::SeqCst), 0);
        let before = inner.counters().snapshot();
        assert!(
            lock.try_acquire(&key("retry")).await.unwrap().is_none(),
            "409 is an answer, not retried"
        );
        assert_eq!(
            inner.counters().snapshot().since(&before).get(Op::LeaseAcquire),
            1
        );
        guard.release().await.unwrap();
    }

    /// Renewals that keep failing transiently are retried with growing pauses (twice the
    /// minimum, doubling, capped at the maximum), not back to back, until the local deadline.
    #[tokio::test(start_paused = true)]
    async fn failing_renewals_back_off() {
        let flaky = Arc::new(Flaky {
            fail_renewals: true.into(),
            ..Flaky::over(Arc::new(MemoryStore::new()))
        });
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let start = tokio::time::Instant::now();
        let guard = lock.try_acquire(&key("pace")).await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_secs(30), guard.lost().cancelled())
            .await
            .expect("lost at the local deadline");
        let sent: Vec<u64> = flaky
            .renewals
            .lock()
            .unwrap()
            .iter()
            .map(|t| (*t - start).as_millis() as u64)
            .collect();
        // renew_every 3 s, then pauses of 0.4, 0.8, 1.6 s and 2 s (the cap) until the
        // deadline at 15 s − 2 s.
        assert_eq!(sent, [3000, 3400, 4200, 5800, 7800, 9800, 11800]);
    }

    /// On a key's first use (no lock blob yet), an acquire that fails after creating the blob is
    /// an error, never "held by someone else".
    #[tokio::test(start_paused = true)]
    async fn a_failed_acquire_at_first_use_is_an_error() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        // The first acquire finds no blob (the memory store answers 404); the second fails.
        flaky.inject(Op::LeaseAcquire, StoreErrorKind::NotFound);
        flaky.inject(Op::LeaseAcquire, StoreErrorKind::Rejected);
        let err = lock.try_acquire(&key("first")).await.unwrap_err();
        assert_refused(&err);
        // With the blob in place, the next try takes the key.
        let guard = lock.try_acquire(&key("first")).await.unwrap();
        assert!(guard.is_some());
    }

    /// Losing the race for a key's first use (another caller created the blob and took the
    /// lease between our 404 and our second acquire) is "held", not an error.
    #[tokio::test(start_paused = true)]
    async fn losing_the_first_use_race_is_held_not_an_error() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let winner = lock.try_acquire(&key("race")).await.unwrap().unwrap();
        // Our first acquire still found no blob; the winner's came next.
        flaky.inject(Op::LeaseAcquire, StoreErrorKind::NotFound);
        assert!(lock.try_acquire(&key("race")).await.unwrap().is_none());
        winner.release().await.unwrap();
    }

    /// `acquire` waits while the key is held or its own lease id is being broken, and returns
    /// any other storage error at once instead of waiting out its timeout.
    #[tokio::test(start_paused = true)]
    async fn acquire_waits_for_held_or_breaking_and_fails_fast_otherwise() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky::over(inner.clone()));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let k = key("wait");
        lock.try_acquire(&k)
            .await
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();

        let start = tokio::time::Instant::now();
        flaky.inject(Op::LeaseAcquire, StoreErrorKind::Rejected);
        let err = lock.acquire(&k, Duration::from_secs(30)).await.unwrap_err();
        assert_refused(&err);
        assert_eq!(start.elapsed(), Duration::ZERO, "no waiting on a refusal");

        flaky.inject(Op::LeaseAcquire, StoreErrorKind::LeaseBreaking);
        let guard = lock.acquire(&k, Duration::from_secs(30)).await.unwrap();
        assert!(start.elapsed() > Duration::ZERO, "waited out the break");
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());

        // Held by someone else: tries again with growing pauses until the timeout, then says so.
        let other = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let before = inner.counters().snapshot();
        let start = tokio::time::Instant::now();
        let err = other.acquire(&k, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(err, leasehold_lock::Error::Timeout { .. }), "{err:?}");
        assert_eq!(start.elapsed(), Duration::from_secs(5), "gives up at the timeout");
        let tries = inner.counters().snapshot().since(&before).get(Op::LeaseAcquire);
        // 50 ms doubling to 2 s, jittered: about eight tries in 5 s, never a tight loop.
        assert!((4..=15).contains(&tries), "{tries} tries in 5 s");
        // The same pacing for several keys at once.
        let before = inner.counters().snapshot();
        let err = other
            .acquire_many(&[key("free"), k.clone()], Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, leasehold_lock::Error::Timeout { .. }), "{err:?}");
        let tries = inner.counters().snapshot().since(&before).get(Op::LeaseAcquire);
        assert!((8..=30).contains(&tries), "{tries} acquires in 5 s for two keys");
        guard.release().await.unwrap();
        // Once free, acquire_many takes both.
        let both = other
            .acquire_many(&[key("free"), k.clone()], Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(both.guards().len(), 2);
        both.release().await.unwrap();
    }

    /// `inspect` reports a storage failure as an error, never as "free, never used".
    #[tokio::test(start_paused = true)]
    async fn inspect_does_not_mistake_a_failure_for_a_free_key() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let guard = lock.try_acquire(&key("seen")).await.unwrap().unwrap();
        flaky.inject(Op::BlobProperties, StoreErrorKind::Rejected);
        let err = lock.inspect(&key("seen")).await.unwrap_err();
        assert_refused(&err);
        assert!(lock.inspect(&key("seen")).await.unwrap().held);
        guard.release().await.unwrap();
    }

    /// A first acquire refused for another reason than a missing blob is that error: the lock
    /// blob is not created and nothing is tried again.
    #[tokio::test(start_paused = true)]
    async fn a_refused_first_acquire_creates_nothing() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky::over(inner.clone()));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        flaky.inject(Op::LeaseAcquire, StoreErrorKind::Rejected);
        let err = lock.try_acquire(&key("refused")).await.unwrap_err();
        assert_refused(&err);
        assert_eq!(inner.counters().snapshot().get(Op::BlobCreate), 0);
        assert_eq!(inner.counters().snapshot().get(Op::LeaseAcquire), 0);
    }

    /// Breaking a key that was never used is not an error; a break storage refuses is.
    #[tokio::test(start_paused = true)]
    async fn break_lock_errors() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        lock.break_lock(&key("never-used"), "test").await.unwrap();
        flaky.inject(Op::LeaseBreak, StoreErrorKind::Rejected);
        let err = lock.break_lock(&key("never-used"), "test").await.unwrap_err();
        assert_refused(&err);
    }

    /// The fencing write failing: a lease that ran out meanwhile is `LeaseLost`, any other
    /// failure is that storage error; either way the lease is given back.
    #[tokio::test(start_paused = true)]
    async fn a_failed_fencing_write_is_an_error_of_its_kind() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky::over(inner.clone()));
        let options = LeaseOptions {
            fencing: true,
            ..fast_options()
        };
        let lock = LeaseLock::new(Flaky::store(&flaky), options.clone()).unwrap();
        let k = key("fence");
        flaky.inject(Op::BlobSequenceIncrement, StoreErrorKind::LeaseLost);
        let err = lock.try_acquire(&k).await.unwrap_err();
        assert!(matches!(err, leasehold_lock::Error::LeaseLost { .. }), "{err:?}");
        flaky.inject(Op::BlobSequenceIncrement, StoreErrorKind::Rejected);
        let err = lock.try_acquire(&k).await.unwrap_err();
        assert_refused(&err);
        let other = LeaseLock::new(inner, options).unwrap();
        let guard = other.try_acquire(&k).await.unwrap().expect("given back");
        assert_eq!(guard.fencing_token(), Some(1), "no failed grant counted");
    }

    /// A note write that storage refuses is that refusal, not a lost lease: the holder still
    /// holds (only a write the lease refuses says `LeaseLost`).
    #[tokio::test(start_paused = true)]
    async fn a_refused_note_write_is_storage_s_refusal() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let guard = lock.try_acquire(&key("noted-refused")).await.unwrap().unwrap();
        flaky.inject(Op::BlobSetMetadata, StoreErrorKind::Rejected);
        assert_refused(
            &guard
                .write_notes(&[("streak", Some("1:1".into()))])
                .await
                .unwrap_err(),
        );
        assert!(!guard.is_lost());
        guard
            .write_notes(&[("streak", Some("1:1".into()))])
            .await
            .unwrap();
        assert_eq!(guard.note("streak").await.unwrap().as_deref(), Some("1:1"));
        guard.release().await.unwrap();
    }

    /// A refused move of a block lock blob is the grant's error (the lease given back), not a
    /// blob taken for moved; and an increment refused as if on a block blob when the blob is a
    /// page blob already (a 400 for another reason) never moves it again, which would set its
    /// sequence number back to the generation its metadata recorded.
    #[tokio::test(start_paused = true)]
    async fn a_move_is_made_only_of_a_block_blob_and_its_refusal_is_an_error() {
        let inner = Arc::new(MemoryStore::new());
        inner.put_block_blob("locks/refused", scenarios::block_blob_metadata());
        let flaky = Arc::new(Flaky::over(inner.clone()));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        flaky.inject(Op::BlobCreate, StoreErrorKind::Rejected);
        assert_refused(&lock.try_acquire(&key("refused")).await.unwrap_err());
        assert_eq!(inner.properties("locks/refused").await.unwrap().sequence, None);
        let guard = lock
            .try_acquire(&key("refused"))
            .await
            .unwrap()
            .expect("given back");
        assert_eq!(guard.fencing_token(), Some(6));
        guard.release().await.unwrap();

        #[derive(Debug)]
        struct NotAPageBlobOnce(OpCounters, AtomicUsize);
        #[async_trait]
        impl Interceptor for NotAPageBlobOnce {
            async fn call<T: Send + 'static>(&self, op: Op, _: &str, effect: Effect<T>) -> StoreResult<T> {
                if op == Op::BlobSequenceIncrement && self.1.fetch_add(1, Ordering::SeqCst) == 0 {
                    // What `increment_sequence` answers for a block blob; nothing happened.
                    let none: Box<dyn std::any::Any> = Box::new(None::<(u64, leasehold_lock::ETag)>);
                    return Ok(*none.downcast::<T>().expect("the increment's answer"));
                }
                effect.await
            }
            fn counters(&self) -> &OpCounters {
                &self.0
            }
        }
        let once = Arc::new(NotAPageBlobOnce(OpCounters::new(), AtomicUsize::new(0)));
        let lock = LeaseLock::new(Arc::new(FaultyStore::new(inner.clone(), once)), fast_options()).unwrap();
        let guard = lock.try_acquire(&key("refused")).await.unwrap().unwrap();
        assert_eq!(
            guard.fencing_token(),
            Some(7),
            "never back to the metadata's generation"
        );
        guard.release().await.unwrap();
    }

    /// Work set with `before_each_renewal` runs just before each renewal is sent (started a
    /// quarter of a second early, and the renewal follows as soon as it is done), and work that
    /// hangs holds a renewal back by a fifth of the interval at most: the lease is kept.
    #[tokio::test(start_paused = true)]
    async fn work_before_each_renewal_runs_just_before_it_and_never_holds_it_back_long() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let guard = lock.try_acquire(&key("before")).await.unwrap().unwrap();
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let hang = Arc::new(std::sync::atomic::AtomicBool::new(false));
        guard.before_each_renewal(Arc::new({
            let (calls, hang) = (calls.clone(), hang.clone());
            move || {
                let (calls, hang) = (calls.clone(), hang.clone());
                Box::pin(async move {
                    calls.lock().unwrap().push(tokio::time::Instant::now());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if hang.load(Ordering::SeqCst) {
                        std::future::pending::<()>().await;
                    }
                })
            }
        }));
        tokio::time::sleep(Duration::from_secs(10)).await;
        let paired = |from: usize| {
            let calls = calls.lock().unwrap().clone();
            let renewals = flaky.renewals.lock().unwrap().clone();
            assert_eq!(calls.len(), renewals.len(), "{calls:?} {renewals:?}");
            calls[from..]
                .iter()
                .zip(&renewals[from..])
                .map(|(c, r)| *r - *c)
                .collect::<Vec<_>>()
        };
        // Every 3 s: work for 100 ms, then the renewal at once.
        let quick = paired(0);
        assert_eq!(quick.len(), 3, "{quick:?}");
        assert!(
            quick.iter().all(|d| *d == Duration::from_millis(100)),
            "{quick:?}"
        );
        hang.store(true, Ordering::SeqCst);
        let before = calls.lock().unwrap().len();
        tokio::time::sleep(Duration::from_secs(12)).await;
        // Hung work: the renewal goes out 0.6 s (3 s / 5) after it started, and the lease holds.
        let hung = paired(before);
        assert!(hung.len() >= 3, "{hung:?}");
        assert!(hung.iter().all(|d| *d == Duration::from_millis(600)), "{hung:?}");
        assert!(!guard.is_lost());
        assert!(format!("{guard:?}").contains("BeforeSlot(set)"), "{guard:?}");
        guard.release().await.unwrap();

        // The early start is a quarter of a second, or a tenth of a shorter renewal interval:
        // renewed every second, the work starts 100 ms before the renewal is due.
        let lock = LeaseLock::new(
            Arc::new(MemoryStore::new()),
            LeaseOptions {
                renew_every: Duration::from_secs(1),
                ..fast_options()
            },
        )
        .unwrap();
        let guard = lock.try_acquire(&key("before-short")).await.unwrap().unwrap();
        let granted = tokio::time::Instant::now();
        let (called, when) = tokio::sync::oneshot::channel();
        let called = std::sync::Mutex::new(Some(called));
        guard.before_each_renewal(Arc::new(move || {
            if let Some(called) = called.lock().unwrap().take() {
                let _ = called.send(tokio::time::Instant::now());
            }
            Box::pin(async {})
        }));
        assert_eq!(when.await.unwrap() - granted, Duration::from_millis(900));
        guard.release().await.unwrap();
    }

    /// Work set after the grant, on a store whose every request takes a while (so the renewer
    /// has long been waiting for its first renewal), still runs before the first renewal and
    /// every one after (found by review: the renewer read the work once, before its sleep).
    #[tokio::test(start_paused = true)]
    async fn work_set_after_the_grant_runs_before_the_first_renewal() {
        #[derive(Debug, Default)]
        struct Slow(OpCounters);
        #[async_trait]
        impl Interceptor for Slow {
            async fn call<T: Send + 'static>(&self, op: Op, _: &str, effect: Effect<T>) -> StoreResult<T> {
                self.0.record(op);
                tokio::time::sleep(Duration::from_millis(20)).await;
                effect.await
            }
            fn counters(&self) -> &OpCounters {
                &self.0
            }
        }
        let slow = Arc::new(Slow::default());
        let lock = LeaseLock::new(
            Arc::new(FaultyStore::new(Arc::new(MemoryStore::new()), slow.clone())),
            fast_options(),
        )
        .unwrap();
        let guard = lock.try_acquire(&key("late-work")).await.unwrap().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        guard.before_each_renewal(Arc::new({
            let calls = calls.clone();
            move || {
                calls.fetch_add(1, Ordering::SeqCst);
                Box::pin(async {})
            }
        }));
        tokio::time::sleep(Duration::from_secs(10)).await;
        let renewals = slow.0.snapshot().get(Op::LeaseRenew);
        assert_eq!(renewals, 3);
        assert_eq!(calls.load(Ordering::SeqCst), 3, "once before each renewal");
        guard.release().await.unwrap();
    }

    /// A shared join passes storage's refusals on (a refused read is not a missing blob, a
    /// refused write is not churn), and rides out churn (the blob changed between its read and
    /// its write) by reading again after pauses of 10 ms, 20 ms, ...
    #[tokio::test(start_paused = true)]
    async fn a_shared_join_reports_refusals_and_rides_out_churn() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let k = key("shared-join-errors");
        flaky.inject(Op::BlobProperties, StoreErrorKind::Rejected);
        assert_refused(&lock.try_acquire_shared(&k, "batch").await.unwrap_err());
        flaky.inject(Op::BlobSetMetadata, StoreErrorKind::Rejected);
        assert_refused(&lock.try_acquire_shared(&k, "batch").await.unwrap_err());
        flaky.inject(Op::BlobSetMetadata, StoreErrorKind::ConditionNotMet);
        flaky.inject(Op::BlobSetMetadata, StoreErrorKind::LeaseLost);
        let start = tokio::time::Instant::now();
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap();
        assert!(member.is_some(), "joined after two rounds of churn");
        assert_eq!(start.elapsed(), Duration::from_millis(10 + 20));
    }

    /// The same for a founder's increment of the sequence number (the session's new token): a
    /// refusal is passed on; churn (the blob changed since the read, or the lease went) makes it
    /// read again after pauses of 10 ms, 20 ms, ...
    #[tokio::test(start_paused = true)]
    async fn a_shared_founder_reports_a_refused_increment_and_rides_out_churn() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let k = key("shared-founder-errors");
        flaky.inject(Op::BlobSequenceIncrement, StoreErrorKind::Rejected);
        assert_refused(&lock.try_acquire_shared(&k, "batch").await.unwrap_err());
        flaky.inject(Op::BlobSequenceIncrement, StoreErrorKind::ConditionNotMet);
        flaky.inject(Op::BlobSequenceIncrement, StoreErrorKind::LeaseLost);
        let start = tokio::time::Instant::now();
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap();
        assert_eq!(member.as_ref().and_then(|m| m.fencing_token()), Some(1));
        assert_eq!(start.elapsed(), Duration::from_millis(10 + 20));
    }

    /// A join that meets churn on every attempt gives up saying so (contended), not as a
    /// configuration error.
    #[tokio::test(start_paused = true)]
    async fn a_shared_join_under_endless_churn_reports_contention() {
        let flaky = Arc::new(Flaky::over(Arc::new(MemoryStore::new())));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        let k = key("shared-join-contended");
        for _ in 0..16 {
            flaky.inject(Op::BlobSetMetadata, StoreErrorKind::ConditionNotMet);
        }
        let err = lock.try_acquire_shared(&k, "batch").await.unwrap_err();
        assert!(
            matches!(&err, leasehold_lock::Error::Contended { attempts: 16, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("shared-join-contended"), "{err}");
    }

    /// A shared member's leave: a refused read or write, or a refused release, is an error; a
    /// missing blob, a lease already lost and a member joining before the last one's release
    /// are not (nothing of ours is left to give back, or the key stays held by the newcomer);
    /// churn is read again after pauses of 10 ms, 20 ms, ...
    #[tokio::test(start_paused = true)]
    async fn a_shared_leave_reports_refusals_and_rides_out_churn() {
        let inner = Arc::new(MemoryStore::new());
        let flaky = Arc::new(Flaky::over(inner.clone()));
        let lock = LeaseLock::new(Flaky::store(&flaky), fast_options()).unwrap();
        for (n, (op, kind, refused)) in [
            (Op::BlobProperties, StoreErrorKind::Rejected, true),
            (Op::BlobProperties, StoreErrorKind::NotFound, false),
            (Op::BlobSetMetadata, StoreErrorKind::Rejected, true),
            (Op::BlobSetMetadata, StoreErrorKind::LeaseLost, false),
            (Op::LeaseRelease, StoreErrorKind::Rejected, true),
            (Op::LeaseRelease, StoreErrorKind::ConditionNotMet, false),
        ]
        .into_iter()
        .enumerate()
        {
            let k = key(&format!("shared-leave-errors/{n}"));
            let member = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
            flaky.inject(op, kind);
            let left = member.release().await;
            if refused {
                assert_refused(&left.unwrap_err());
            } else {
                assert!(left.is_ok(), "{op} answering {kind:?}: {left:?}");
            }
        }

        let k = key("shared-leave-churn");
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        flaky.inject(Op::BlobSetMetadata, StoreErrorKind::ConditionNotMet);
        flaky.inject(Op::BlobSetMetadata, StoreErrorKind::ConditionNotMet);
        let start = tokio::time::Instant::now();
        member.release().await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(10 + 20));
        let next = lock.try_acquire(&k).await.unwrap().expect("left and released");
        next.release().await.unwrap();

        // A member whose lease is gone (broken and taken) reads once, and its write of the
        // list (the exclusive grant left the group's metadata in place) is refused: nothing
        // changes.
        let k = key("shared-leave-gone");
        let member = lock.try_acquire_shared(&k, "batch").await.unwrap().unwrap();
        lock.break_lock_after(&k, "test", Duration::ZERO).await.unwrap();
        let other = lock.try_acquire(&k).await.unwrap().expect("free after the break");
        let before = inner.counters().snapshot();
        member.release().await.unwrap();
        let sent = inner.counters().snapshot().since(&before);
        assert_eq!(
            (
                sent.get(Op::BlobProperties),
                sent.get(Op::BlobSetMetadata),
                sent.total()
            ),
            (1, 1, 2),
            "{sent}"
        );
        assert!(
            lock.inspect(&k).await.unwrap().held,
            "still the exclusive holder's"
        );
        other.release().await.unwrap();
    }

    /// The error is storage's definitive refusal (what the tests inject), passed on as is.
    fn assert_refused(err: &leasehold_lock::Error) {
        assert!(
            matches!(err, leasehold_lock::Error::Storage(e) if e.kind() == StoreErrorKind::Rejected),
            "{err:?}"
        );
    }

    /// A store that fails chosen calls, in front of a memory store: renewals, acquires of an
    /// existing blob and releases transiently by count, and any call once with an error of a
    /// chosen kind (`inject`, taken in order). Records when each renewal was sent.
    #[derive(Debug)]
    struct Flaky {
        inner: Arc<MemoryStore>,
        fail_renewals: std::sync::atomic::AtomicBool,
        fail_acquires: AtomicUsize,
        fail_releases: AtomicUsize,
        inject: std::sync::Mutex<std::collections::VecDeque<(Op, StoreErrorKind)>>,
        renewals: std::sync::Mutex<Vec<tokio::time::Instant>>,
    }

    impl Flaky {
        fn over(inner: Arc<MemoryStore>) -> Self {
            Flaky {
                inner,
                fail_renewals: false.into(),
                fail_acquires: 0.into(),
                fail_releases: 0.into(),
                inject: Default::default(),
                renewals: Default::default(),
            }
        }

        /// Fails the next `op` with an error of `kind` (after any already injected for it).
        fn inject(&self, op: Op, kind: StoreErrorKind) {
            self.inject.lock().unwrap().push_back((op, kind));
        }

        fn injected(&self, op: Op) -> StoreResult<()> {
            let mut inject = self.inject.lock().unwrap();
            match inject.iter().position(|(o, _)| *o == op) {
                Some(i) => {
                    let (_, kind) = inject.remove(i).unwrap();
                    Err(StoreError::new(kind, op, "injected"))
                }
                None => Ok(()),
            }
        }
    }

    fn transient(op: Op) -> StoreError {
        StoreError::new(StoreErrorKind::Transient, op, "injected").with_status(503, Some("ServerBusy".into()))
    }

    impl Flaky {
        /// The lock's store: every request goes through these rules to the memory store.
        fn store(flaky: &Arc<Flaky>) -> Arc<dyn LeaseStore> {
            Arc::new(FaultyStore::new(flaky.inner.clone(), flaky.clone()))
        }

        fn take_one(counter: &AtomicUsize) -> bool {
            counter
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        }
    }

    #[async_trait]
    impl Interceptor for Flaky {
        async fn call<T: Send + 'static>(&self, op: Op, blob: &str, effect: Effect<T>) -> StoreResult<T> {
            match op {
                Op::LeaseAcquire => {
                    if self.inner.counters().snapshot().get(Op::LeaseAcquire) > 1_000 {
                        // Tries back to back would spin with time paused: let time move
                        // instead, so the test fails on its counts.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    self.injected(op)?;
                    let exists = self.inner.properties(blob).await.is_ok();
                    if exists && Flaky::take_one(&self.fail_acquires) {
                        return Err(transient(op));
                    }
                }
                Op::LeaseRenew => {
                    let sent = {
                        let mut renewals = self.renewals.lock().unwrap();
                        renewals.push(tokio::time::Instant::now());
                        renewals.len()
                    };
                    if sent > 100 {
                        // A renewer retrying back to back would spin with time paused; let
                        // time move so the test ends (and fails on the count) instead of hanging.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    self.injected(op)?;
                    if self.fail_renewals.load(Ordering::SeqCst) {
                        return Err(transient(op));
                    }
                }
                Op::LeaseRelease => {
                    self.injected(op)?;
                    if Flaky::take_one(&self.fail_releases) {
                        return Err(transient(op));
                    }
                }
                _ => self.injected(op)?,
            }
            effect.await
        }

        fn counters(&self) -> &OpCounters {
            self.inner.counters()
        }
    }

    /// Holds the first blob read after `arm` (once it took effect) until `open`: stages "read
    /// the lock blob, then something happens, then go on".
    #[derive(Debug, Default)]
    struct ReadGate {
        counters: OpCounters,
        armed: std::sync::atomic::AtomicBool,
        read: tokio::sync::Notify,
        go: tokio::sync::Notify,
    }

    impl ReadGate {
        fn arm(&self) {
            self.armed.store(true, Ordering::SeqCst);
        }

        async fn wait_read(&self) {
            self.read.notified().await;
        }

        fn open(&self) {
            self.go.notify_one();
        }
    }

    #[async_trait]
    impl Interceptor for ReadGate {
        async fn call<T: Send + 'static>(&self, op: Op, _blob: &str, effect: Effect<T>) -> StoreResult<T> {
            let result = effect.await;
            if op == Op::BlobProperties && self.armed.swap(false, Ordering::SeqCst) {
                self.read.notify_one();
                self.go.notified().await;
            }
            result
        }

        fn counters(&self) -> &OpCounters {
            &self.counters
        }
    }

    /// Loses the answer of the first request of kind `op` after it took effect (a time-out: no
    /// answer came, the request landed).
    #[derive(Debug)]
    struct LoseAnswer {
        counters: OpCounters,
        op: Op,
        lost: AtomicUsize,
    }

    impl LoseAnswer {
        fn of(op: Op) -> Self {
            LoseAnswer {
                counters: OpCounters::new(),
                op,
                lost: 0.into(),
            }
        }
    }

    #[async_trait]
    impl Interceptor for LoseAnswer {
        async fn call<T: Send + 'static>(&self, op: Op, _blob: &str, effect: Effect<T>) -> StoreResult<T> {
            let result = effect.await;
            if op == self.op && self.lost.load(Ordering::SeqCst) == 0 {
                self.lost.store(1, Ordering::SeqCst);
                return Err(StoreError::timeout(op, Duration::from_secs(10)));
            }
            result
        }

        fn counters(&self) -> &OpCounters {
            &self.counters
        }
    }
}
