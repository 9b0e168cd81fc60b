use super::store::{PAUSE_MS, shared_pause};
use super::*;

fn scope(s: &str) -> Scope {
    Scope::parse(s).unwrap()
}

/// A pause read in the second it was written (both `Last-Modified` and `Date` to the
/// second) never says more than its length; a second later it says what is left of it,
/// never less than the writer's own clock would.
#[test]
fn a_pause_read_says_no_more_than_its_length_nor_less_than_is_left() {
    let at = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let timed = |answered: u64| leasehold_storage::azure::TimedMetadata {
        metadata: HashMap::from([(PAUSE_MS.to_string(), "300000".to_string())]),
        last_modified: Some(at),
        answered_at: Some(at + Duration::from_secs(answered)),
    };
    assert_eq!(shared_pause(&timed(0)).left, Duration::from_secs(300));
    assert_eq!(shared_pause(&timed(1)).left, Duration::from_secs(300));
    assert_eq!(shared_pause(&timed(2)).left, Duration::from_secs(299));
    assert_eq!(shared_pause(&timed(400)).left, Duration::ZERO);
}

fn budgets(max: usize) -> (Budgets, Arc<MemoryBudgets>) {
    let store = Arc::new(MemoryBudgets::new());
    let options = BudgetOptions {
        max_concurrency: max,
        ..BudgetOptions::default()
    };
    (Budgets::new(store.clone(), options), store)
}

async fn go(b: &Budgets, lane: Lane) -> BudgetPermit {
    match b.admit(&scope("account"), lane, None, true).await {
        Admission::Go(p) => p,
        other => panic!("expected a slot, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_throttle_cuts_to_the_concurrency_the_downstream_took_and_growth_stops_below_it() {
    let (b, _) = budgets(8);
    let mut permits = Vec::new();
    for _ in 0..8 {
        permits.push(go(&b, Lane::High).await);
    }
    // The downstream takes 3 at once: the 5th and then the 4th come back refused, in one
    // pause. The first cuts to 4, the second shows 3 was the most.
    permits[4].throttled("r", Duration::from_secs(2), false).await;
    assert_eq!(b.views()[0].limit, 4);
    permits[3].throttled("r", Duration::from_secs(2), false).await;
    assert_eq!(b.views()[0].limit, 3);
    drop(permits);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Successes do not take it back over the concurrency that was refused…
    for _ in 0..PROBE_AFTER * 4 - 1 {
        go(&b, Lane::High).await.succeeded();
    }
    assert_eq!(b.views()[0].limit, 3);
    // …until enough windows and enough time have passed: then it probes beyond.
    for _ in 0..5 {
        go(&b, Lane::High).await.succeeded();
    }
    assert_eq!(b.views()[0].limit, 3, "windows enough, but 3 s since the cut");
    tokio::time::sleep(PROBE_EVERY).await;
    for _ in 0..5 {
        go(&b, Lane::High).await.succeeded();
    }
    assert_eq!(b.views()[0].limit, 4);
    // A refusal at 4 in flight shows 3 was the most; refusals go on lowering it, never
    // below 1.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(go(&b, Lane::High).await);
    }
    held[3].throttled("r", Duration::from_secs(1), false).await;
    assert_eq!(b.views()[0].limit, 3);
    drop(held);
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let _first = go(&b, Lane::High).await;
        let mut p = futures_like(&b, 1).await.remove(0);
        p.throttled("r", Duration::from_secs(1), false).await;
    }
    assert_eq!(b.views()[0].limit, 1);
    // A refusal with nothing else in flight shows nothing of the downstream's concurrency:
    // it pauses, but does not cut.
    let (b, _) = budgets(4);
    let mut p = go(&b, Lane::High).await;
    p.throttled("r", Duration::from_secs(1), false).await;
    assert_eq!(
        (b.views()[0].limit, b.views()[0].paused_for),
        (4, Duration::from_secs(1))
    );
}

/// A probe beyond the level that worked, refused, goes back to that level even when the run
/// refused started early (a later one reached the downstream first, so its position shows
/// less than the downstream took). Without the floor it would cut to 1 here, and stay below
/// what works until the next probe.
#[tokio::test(start_paused = true)]
async fn a_refused_probe_goes_back_to_the_level_that_worked() {
    let (b, _) = budgets(8);
    let mut permits = Vec::new();
    for _ in 0..4 {
        permits.push(go(&b, Lane::High).await);
    }
    permits[3].throttled("r", Duration::from_secs(1), false).await;
    assert_eq!(b.views()[0].limit, 3);
    drop(permits);
    tokio::time::sleep(PROBE_EVERY).await;
    for _ in 0..PROBE_AFTER * 4 + 4 {
        go(&b, Lane::High).await.succeeded();
    }
    assert_eq!(b.views()[0].limit, 4, "probing");
    let mut early = go(&b, Lane::High).await;
    let _others: Vec<_> = futures_like(&b, 3).await;
    early.throttled("r", Duration::from_secs(1), false).await;
    assert_eq!(b.views()[0].limit, 3);
    // Refused again at the level that worked (the downstream took less since): a cut as
    // any.
    drop((early, _others));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _p = go(&b, Lane::High).await;
    let mut q = go(&b, Lane::High).await;
    q.throttled("r", Duration::from_secs(1), false).await;
    assert_eq!(b.views()[0].limit, 1);
}

/// The probe begins at the success that completes its windows, not one later (the limit is
/// read unrounded: growth is by a fraction per success).
#[tokio::test(start_paused = true)]
async fn growth_beyond_the_refused_level_begins_when_its_windows_are_complete() {
    let (b, _) = budgets(8);
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(go(&b, Lane::High).await);
    }
    held[3].throttled("r", Duration::from_secs(1), false).await;
    drop(held);
    tokio::time::sleep(PROBE_EVERY).await;
    let limit = |b: &Budgets| b.with_budget(DEFAULT_BUDGET, |x| x.limit);
    for _ in 0..PROBE_AFTER * 4 - 1 {
        go(&b, Lane::High).await.succeeded();
    }
    assert_eq!(limit(&b), 3.0);
    go(&b, Lane::High).await.succeeded();
    assert!(limit(&b) > 3.0, "{}", limit(&b));
}

/// `n` slots taken as carriers take them (beyond the limit).
async fn futures_like(b: &Budgets, n: usize) -> Vec<BudgetPermit> {
    let mut v = Vec::new();
    for _ in 0..n {
        match b.admit(&scope("account"), Lane::High, None, false).await {
            Admission::Go(p) => v.push(p),
            other => panic!("{other:?}"),
        }
    }
    v
}

#[tokio::test(start_paused = true)]
async fn a_refusal_that_shows_no_lower_concurrency_halves_the_limit() {
    let (b, _) = budgets(8);
    // Another worker fills the downstream: this one's second run is refused, at 2 in flight,
    // with its limit at 8: cut to 1 (what it shows). With the limit at 4 and the refusal at
    // 6 (carriers beyond the limit): halved.
    let mut first = go(&b, Lane::High).await;
    let mut second = go(&b, Lane::High).await;
    second.throttled("r", Duration::from_millis(10), false).await;
    assert_eq!(b.views()[0].limit, 1);
    first.succeeded();
    drop((first, second));
    let (b, _) = budgets(4);
    let mut held = futures_like(&b, 6).await;
    held[5].throttled("r", Duration::from_millis(10), false).await;
    assert_eq!(b.views()[0].limit, 2, "halved from 4");
    // Refused at exactly one more than the limit: it shows the limit itself, no cut, so
    // halved too.
    let (b, _) = budgets(4);
    let mut held = futures_like(&b, 5).await;
    held[4].throttled("r", Duration::from_millis(10), false).await;
    assert_eq!(b.views()[0].limit, 2, "halved from 4");
}

#[tokio::test(start_paused = true)]
async fn a_paused_budget_turns_deliveries_away_until_the_pause_ends_and_shares_it() {
    let (b, store) = budgets(4);
    let mut p = go(&b, Lane::High).await;
    p.throttled("r", Duration::from_secs(30), false).await;
    drop(p);
    // Before the lock: turned away for the rest of the pause, whatever the scope.
    assert_eq!(
        b.paused(&scope("contact")),
        Some((DEFAULT_BUDGET.to_string(), Duration::from_secs(30)))
    );
    // A holder with a bounded wait (Functions) is put off by a pause that outlasts it…
    match b
        .admit(&scope("contact"), Lane::Low, Some(Duration::from_secs(20)), true)
        .await
    {
        Admission::Paused { budget, after, by } => {
            assert_eq!(budget, DEFAULT_BUDGET);
            assert_eq!(after, Duration::from_secs(30));
            assert_eq!(by, HeldBy::Pause);
        }
        other => panic!("{other:?}"),
    }
    // …a carrier is not (nor by the limit: it takes a slot beyond it)…
    let mut held = Vec::new();
    for _ in 0..5 {
        match b
            .admit(
                &scope("contact"),
                Lane::High,
                Some(Duration::from_secs(20)),
                false,
            )
            .await
        {
            Admission::Go(p) => held.push(p),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(b.views()[0].in_flight, 5);
    drop(held);
    // …and one without a bound (standalone) waits it out, under its lease.
    let started = Instant::now();
    assert!(matches!(
        b.admit(&scope("contact"), Lane::High, None, true).await,
        Admission::Go(_)
    ));
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert!(store.paused_until(DEFAULT_BUDGET).is_some());

    // Another worker on the same store learns of a pause at its first look's read.
    let mut p = go(&b, Lane::High).await;
    p.throttled("r", Duration::from_secs(30), false).await;
    drop(p);
    let other = Budgets::new(store.clone(), BudgetOptions::default());
    assert_eq!(
        other.paused(&scope("account")),
        None,
        "the first look does not wait for the read"
    );
    tokio::task::yield_now().await;
    let (_, after) = other.paused(&scope("account")).expect("paused once read");
    assert!(after > Duration::from_secs(25), "{after:?}");
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(other.paused(&scope("account")), None);
}

#[tokio::test(start_paused = true)]
async fn a_throttle_that_does_not_lengthen_the_pause_is_not_written_again() {
    let (b, store) = budgets(4);
    let mut p1 = go(&b, Lane::High).await;
    let mut p2 = go(&b, Lane::High).await;
    p1.throttled("r", Duration::from_secs(10), false).await;
    p2.throttled("r", Duration::from_secs(10), false).await;
    assert_eq!(store.counters().snapshot().get(Op::BudgetWrite), 1);
}

#[tokio::test(start_paused = true)]
async fn the_high_lane_takes_a_free_slot_before_the_low_lane() {
    let (b, _) = budgets(1);
    let held = go(&b, Lane::Low).await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let low = {
        let (b, order) = (b.clone(), order.clone());
        tokio::spawn(async move {
            let _p = go(&b, Lane::Low).await;
            order.lock().unwrap().push("low");
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let high = {
        let (b, order) = (b.clone(), order.clone());
        tokio::spawn(async move {
            let _p = go(&b, Lane::High).await;
            order.lock().unwrap().push("high");
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(held);
    high.await.unwrap();
    low.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["high", "low"]);
}

#[tokio::test(start_paused = true)]
async fn a_bounded_wait_for_a_slot_comes_back_soon() {
    let (b, _) = budgets(1);
    let _held = go(&b, Lane::High).await;
    match b
        .admit(&scope("a"), Lane::High, Some(Duration::from_secs(5)), true)
        .await
    {
        Admission::Paused { after, by, .. } => {
            // Its turn: one run's time (a second, none measured yet) per slot of the limit.
            assert_eq!((after, by), (Duration::from_secs(1), HeldBy::Limit));
        }
        other => panic!("{other:?}"),
    }
}

/// A record put off by a throttle and refused again (its chain's next hop) is one record's
/// refusal: counted, but neither pause nor cut, so its chain of `Retry-After: 1` hops does
/// not hold the budget's limit down while it lasts (issue 35, item 2).
#[tokio::test(start_paused = true)]
async fn a_throttled_records_chain_is_one_throttle_for_its_budget() {
    let (b, store) = budgets(4);
    let other = go(&b, Lane::High).await;
    let mut first = go(&b, Lane::High).await;
    first.throttled("chain", Duration::from_secs(1), false).await;
    drop((first, other));
    assert_eq!(b.views()[0].limit, 1, "the first refusal, at 2 in flight, cuts");
    let writes = store.counters().snapshot().get(Op::BudgetWrite);
    tokio::time::sleep(Duration::from_secs(2)).await;
    for _ in 0..20 {
        let mut hop = go(&b, Lane::High).await;
        hop.throttled("chain", Duration::from_secs(1), true).await;
        drop(hop);
        let view = &b.views()[0];
        assert_eq!(view.paused_for, Duration::ZERO, "a hop does not pause the budget");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(
        store.counters().snapshot().get(Op::BudgetWrite),
        writes,
        "nor writes a pause"
    );
    assert_eq!(b.views()[0].record_refusals, 20);
    // So the limit grows back with the budget's successes, as if the chain were not there.
    tokio::time::sleep(PROBE_EVERY).await;
    for _ in 0..PROBE_AFTER * 2 + 10 {
        go(&b, Lane::High).await.succeeded();
    }
    assert!(b.views()[0].limit >= 2, "{:?}", b.views());
}

/// A throttled chain's refusal beside another record's (a throttled downstream refuses
/// many: a bulk import's chains) counts for the budget: it pauses it and, with others in
/// flight, cuts. Another record's refusal counts while within the pause asked and 30 s.
#[tokio::test(start_paused = true)]
async fn a_chains_refusal_beside_another_records_is_the_downstreams() {
    let (b, _) = budgets(8);
    let mut a = go(&b, Lane::High).await;
    a.throttled("a", Duration::from_secs(2), true).await;
    drop(a);
    assert_eq!(b.views()[0].record_refusals, 1, "alone: a record's refusal");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let held = futures_like(&b, 3).await;
    let mut c = go(&b, Lane::High).await;
    c.throttled("c", Duration::from_secs(2), true).await;
    let view = b.views()[0].clone();
    assert_eq!(
        view.record_refusals, 1,
        "beside a's refusal 10 s before: {view:?}"
    );
    assert!(view.paused_for > Duration::ZERO, "{view:?}");
    assert_eq!(view.limit, 3, "cut to what was in flight before it: {view:?}");
    drop((c, held));
    // The same record again, 40 s on: others' refusals are too old to count beside it.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let mut c = go(&b, Lane::High).await;
    c.throttled("c", Duration::from_secs(2), true).await;
    assert_eq!(b.views()[0].record_refusals, 2, "{:?}", b.views());
}

/// A pause read from storage is capped at the longest allowed, and what storage holds
/// replaces what the worker knew: a shorter pause there shortens it, none ends it (issue
/// 35, item 3).
#[tokio::test(start_paused = true)]
async fn a_pause_read_is_capped_and_follows_storage_down() {
    let store = Arc::new(MemoryBudgets::new());
    let options = BudgetOptions {
        refresh_every: Duration::from_secs(1),
        ..BudgetOptions::default()
    };
    let b = Budgets::new(store.clone(), options);
    let s = scope("account");
    // Two days ahead, as a writer whose clock runs ahead would leave it.
    store.set_paused_until(DEFAULT_BUDGET, Instant::now() + Duration::from_secs(2 * 86_400));
    assert_eq!(b.paused(&s), None, "the first look does not wait for the read");
    tokio::task::yield_now().await;
    let (_, left) = b.paused(&s).expect("paused once read");
    assert_eq!(left, Duration::from_secs(300), "capped at max_pause");
    // Shortened in storage: shorter here at the next read.
    store.set_paused_until(DEFAULT_BUDGET, Instant::now() + Duration::from_secs(20));
    tokio::time::sleep(Duration::from_secs(1)).await;
    b.paused(&s);
    tokio::task::yield_now().await;
    let (_, left) = b.paused(&s).expect("still paused");
    assert!(left <= Duration::from_secs(20), "{left:?}");
    // Resumed by an operator (another process): over here at the next read, and a waiting
    // delivery goes at once.
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.admit(&scope("account"), Lane::High, None, true).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!waiter.is_finished());
    assert!(store.resume(DEFAULT_BUDGET).await.unwrap());
    tokio::time::sleep(Duration::from_secs(1)).await;
    b.paused(&s);
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(waiter.is_finished(), "resumed: the waiting delivery is admitted");
    assert_eq!(b.paused(&s), None);
}

/// A pause of this worker's own whose write failed is kept whatever storage says; one that
/// was written follows storage (a resume ends it).
#[tokio::test(start_paused = true)]
async fn an_own_pause_storage_never_heard_of_stays() {
    #[derive(Debug, Default)]
    struct Refusing(OpCounters);
    #[async_trait]
    impl BudgetStore for Refusing {
        async fn read(&self, _: &str) -> Result<Option<SharedPause>, StoreError> {
            Ok(None)
        }
        async fn write(&self, _: &str, _: Duration, _: u32) -> Result<(), StoreError> {
            Err(StoreError::new(
                leasehold_storage::StoreErrorKind::Transient,
                Op::BudgetWrite,
                "refused",
            ))
        }
        async fn resume(&self, _: &str) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn names(&self) -> Result<Vec<String>, StoreError> {
            Ok(Vec::new())
        }
        fn counters(&self) -> &OpCounters {
            &self.0
        }
    }
    let options = BudgetOptions {
        refresh_every: Duration::from_secs(1),
        ..BudgetOptions::default()
    };
    let b = Budgets::new(Arc::new(Refusing::default()), options);
    let mut p = go(&b, Lane::High).await;
    p.throttled("r", Duration::from_secs(30), false).await;
    drop(p);
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.paused(&scope("account"));
    tokio::task::yield_now().await;
    let (_, left) = b.paused(&scope("account")).expect("kept");
    assert_eq!(left, Duration::from_secs(28));
    // Resumed here: over, whatever it was.
    b.resume(DEFAULT_BUDGET).await.unwrap();
    assert_eq!(b.paused(&scope("account")), None);
}

/// A slot taken at once was not waited for; one taken after a wait was (the runner takes
/// the marker once more only then: issue 35, item 4).
#[tokio::test(start_paused = true)]
async fn a_permit_says_whether_its_delivery_waited() {
    let (b, _) = budgets(1);
    let first = go(&b, Lane::High).await;
    assert!(!first.waited());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = {
        let b = b.clone();
        tokio::spawn(async move { go(&b, Lane::High).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(first);
    assert!(second.await.unwrap().waited());
}

/// While both lanes wait for a budget's slots, every `low_every`-th start is the low lane's
/// (issue 35, item 5): with the limit at 1, a long high-lane backlog cannot hold the low
/// lane's holders (on their records' leases) for its whole length.
#[tokio::test(start_paused = true)]
async fn while_both_lanes_wait_every_fourth_start_is_the_low_lanes() {
    let (b, _) = budgets(1);
    let held = go(&b, Lane::High).await;
    let order = Arc::new(Mutex::new(String::new()));
    let mut tasks = Vec::new();
    for (i, lane) in std::iter::repeat_n(Lane::Low, 3)
        .chain(std::iter::repeat_n(Lane::High, 12))
        .enumerate()
    {
        let (b, order) = (b.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i as u64)).await;
            let _p = go(&b, lane).await;
            order
                .lock()
                .unwrap()
                .push(if lane == Lane::High { 'H' } else { 'L' });
            tokio::time::sleep(Duration::from_secs(1)).await;
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(held);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), "HHHLHHHLHHHLHHH");
}

/// A delivery about to wait at the gate is asked to park (give its consumer slot back);
/// when it cannot, a pause hands it back at once, while a wait for the limit goes on.
#[tokio::test(start_paused = true)]
async fn a_delivery_parks_before_it_waits_and_one_that_cannot_is_handed_back_from_a_pause() {
    let (b, _) = budgets(1);
    let parks = std::sync::atomic::AtomicUsize::new(0);
    let mut p = go(&b, Lane::High).await;
    p.throttled("r", Duration::from_secs(20), false).await;
    drop(p);
    // No seat: handed back for the rest of the pause.
    let no_seat = || {
        parks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        false
    };
    let waiting = Waiting {
        stand_in: false,
        slot: None,
        pause: Some(Duration::from_secs(30)),
        park: Some(&no_seat),
        in_slot: None,
    };
    match b.admit_with(&scope("a"), Lane::High, waiting).await {
        Admission::Paused { after, .. } => assert_eq!(after, Duration::from_secs(20)),
        other => panic!("{other:?}"),
    }
    assert_eq!(parks.load(std::sync::atomic::Ordering::SeqCst), 1);
    // A seat: waits the pause out, parked, and its permit says it waited.
    let seat = || {
        parks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        true
    };
    let waiting = Waiting {
        stand_in: false,
        slot: None,
        pause: Some(Duration::from_secs(30)),
        park: Some(&seat),
        in_slot: None,
    };
    let started = Instant::now();
    match b.admit_with(&scope("a"), Lane::High, waiting).await {
        Admission::Go(p) => assert!(p.waited()),
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(20));
    assert_eq!(parks.load(std::sync::atomic::Ordering::SeqCst), 2);
    // A pause longer than the wait allowed: handed back without parking.
    let mut p = go(&b, Lane::High).await;
    p.throttled("r", Duration::from_secs(120), false).await;
    drop(p);
    let waiting = Waiting {
        stand_in: false,
        slot: None,
        pause: Some(Duration::from_secs(30)),
        park: Some(&seat),
        in_slot: None,
    };
    assert!(matches!(
        b.admit_with(&scope("a"), Lane::High, waiting).await,
        Admission::Paused { .. }
    ));
    assert_eq!(parks.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A delivery that finds no seat waits for the limit in what it holds (the consumer's slot) for
/// `in_slot` at most, then comes back a second later; with a seat it waits as long as it takes.
/// A pause it meets in its slot does not lengthen that: it comes back when the pause ends.
#[tokio::test(start_paused = true)]
async fn a_wait_for_the_limit_without_a_seat_is_bounded_and_a_pause_met_there_does_not_lengthen_it() {
    let (b, _) = budgets(1);
    const NO_SEAT: &(dyn Fn() -> bool + Send + Sync) = &|| false;
    const SEAT: &(dyn Fn() -> bool + Send + Sync) = &|| true;
    let waiting = |park: &'static (dyn Fn() -> bool + Send + Sync)| Waiting {
        stand_in: false,
        slot: None,
        pause: Some(Duration::from_secs(30)),
        park: Some(park),
        in_slot: Some(Duration::from_secs(5)),
    };
    let running = go(&b, Lane::High).await;
    // No seat: back after 5 s, to come again in 1 s.
    let started = Instant::now();
    let a = scope("a");
    let no_seat = tokio::time::timeout(
        Duration::from_secs(60),
        b.admit_with(&a, Lane::High, waiting(NO_SEAT)),
    );
    match no_seat.await.expect("a wait in the slot that ends") {
        Admission::Paused { after, .. } => assert_eq!(after, Duration::from_secs(1)),
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(b.views()[0].in_flight, 1, "it took no slot");
    // A seat: waits until the run ends, however long that is.
    let (b2, started) = (b.clone(), Instant::now());
    let seated = tokio::spawn(async move { b2.admit_with(&scope("a"), Lane::High, waiting(SEAT)).await });
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!seated.is_finished());
    drop(running);
    match seated.await.unwrap() {
        Admission::Go(p) => assert!(p.waited()),
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(60));
    // No seat, waiting for the limit, and then a pause: the wait in the slot is bounded all the
    // same, and the trigger comes back when the pause ends.
    let mut running = go(&b, Lane::High).await;
    let (b2, started) = (b.clone(), Instant::now());
    let in_slot = tokio::spawn(async move { b2.admit_with(&scope("a"), Lane::High, waiting(NO_SEAT)).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!in_slot.is_finished());
    running.throttled("r", Duration::from_secs(20), false).await;
    match in_slot.await.unwrap() {
        Admission::Paused { after, .. } => assert_eq!(after, Duration::from_secs(17)),
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

#[test]
fn pauses_are_bounded() {
    let (b, _) = budgets(1);
    assert_eq!(b.pause_for(None), Duration::from_secs(10));
    assert_eq!(
        b.pause_for(Some(Duration::from_secs(10 * 365 * 86_400))),
        Duration::from_secs(300)
    );
    assert_eq!(b.pause_for(Some(Duration::from_secs(7))), Duration::from_secs(7));
}

/// Triggers handed back for the limit get turns one pace apart (a run's time per slot of the
/// limit: slots free about that often), per lane, behind the deliveries waiting here, and no
/// further than [`MAX_LIMIT_TURN`]; the budget is at its limit only while every slot is taken.
#[tokio::test(start_paused = true)]
async fn triggers_handed_back_for_the_limit_get_turns_at_the_pace_slots_free() {
    let (b, _) = budgets(2);
    let account = scope("account");
    assert!(!b.at_limit(&account, Lane::High));
    // Two runs of 10 s: slots free every 5 s.
    let runs = [go(&b, Lane::High).await, go(&b, Lane::High).await];
    assert!(b.at_limit(&account, Lane::High));
    assert!(b.at_limit(&account, Lane::Low));
    tokio::time::sleep(Duration::from_secs(10)).await;
    drop(runs);
    assert!(!b.at_limit(&account, Lane::High));
    let _runs = [go(&b, Lane::High).await, go(&b, Lane::High).await];
    let turns: Vec<u64> = (0..3)
        .map(|_| b.limit_turn(&account, Lane::High).1.as_secs())
        .collect();
    assert_eq!(turns, [5, 10, 15]);
    // The low lane has its own turns.
    assert_eq!(b.limit_turn(&account, Lane::Low).1, Duration::from_secs(5));
    // Time passes: the turns given keep their place.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(b.limit_turn(&account, Lane::High).1, Duration::from_secs(16));
    // Never beyond the furthest turn.
    for _ in 0..200 {
        assert!(b.limit_turn(&account, Lane::High).1 <= MAX_LIMIT_TURN);
    }
    assert_eq!(b.limit_turn(&account, Lane::High).1, MAX_LIMIT_TURN);
}
