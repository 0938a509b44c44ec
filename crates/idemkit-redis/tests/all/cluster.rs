//! A real Redis Cluster (three primaries, one replica each) on loopback ports,
//! started by the harness and killed by its Drop guard. The conformance suite,
//! the lifecycle suite (phases, parking, the completer's list, the reaper's
//! `SCAN` over every primary, review, list, operator releases) and a 64-way
//! concurrent-claim gate run on it, plus `WAIT` with live replicas.
//!
//! One test drives every case against one cluster (starting a cluster per case
//! would cost seconds each); each case still gets a fresh store under its own
//! key prefix and its own clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{self, claim_req, response, scope};

use crate::common::{cluster_url, have_redis_binaries, unique_prefix};
use crate::harness::{Cluster, info};

async fn cluster_store(urls: &[String], tag: &str, clock: Arc<ManualClock>) -> Arc<RedisStore> {
    let store = RedisStore::connect_with(
        &cluster_url(urls),
        RedisConfig::default().with_prefix(unique_prefix(tag)),
    )
    .await
    .expect("connect to the cluster");
    Arc::new(store.with_test_clock(clock))
}

/// Runs every case of the conformance suite (the list
/// `store_conformance_tests!` runs) concurrently, each on a fresh store and
/// clock; returns the names of those that passed.
async fn run_cases(urls: &[String]) -> Vec<&'static str> {
    let mut set = tokio::task::JoinSet::new();
    for (name, case) in suite::cases::<RedisStore>() {
        let urls = urls.to_vec();
        set.spawn(async move {
            let clock = Arc::new(ManualClock::new());
            let store = cluster_store(&urls, name, clock.clone()).await;
            case(store, clock).await;
            name
        });
    }
    let mut passed = Vec::new();
    while let Some(done) = set.join_next().await {
        passed.push(done.expect("a conformance case failed on the cluster"));
    }
    passed
}

/// Runs every case of the lifecycle suite (`lifecycle_conformance_tests!`)
/// concurrently, each on a fresh store and clock; returns those that passed.
async fn run_lifecycle_cases(urls: &[String]) -> Vec<&'static str> {
    let mut set = tokio::task::JoinSet::new();
    for (name, case) in idemkit_testkit::lifecycle::cases::<RedisStore>() {
        let urls = urls.to_vec();
        set.spawn(async move {
            let clock = Arc::new(ManualClock::new());
            let store = cluster_store(&urls, name, clock.clone()).await;
            case(store, clock).await;
            name
        });
    }
    let mut passed = Vec::new();
    while let Some(done) = set.join_next().await {
        passed.push(done.expect("a lifecycle case failed on the cluster"));
    }
    passed
}

/// Records of 48 accounts, on every primary: `list`, `abandoned`, `reap` and
/// `review` see all of them (their `SCAN` visits each primary), in batches of
/// one account per script.
async fn spread_over_primaries(cluster: &Cluster, urls: &[String]) {
    use idemkit_core::{ListFilter, ReapReport, RecordState};
    let clock = Arc::new(ManualClock::new());
    let store = cluster_store(urls, "spread", clock.clone()).await;
    let mut owners = std::collections::BTreeSet::new();
    for i in 0..48 {
        let s = scope(&format!("acct-{i}"), "k");
        owners.insert(cluster.keyslot(&store.record_key(&s)) / 5462);
        let lease = suite::must_claim(&*store, &claim_req(&s, "{}")).await;
        if i % 2 == 0 {
            store
                .complete(&s, lease.token, &response(201, "x"))
                .await
                .unwrap();
        }
    }
    assert_eq!(owners.len(), 3, "accounts on all three primaries");
    let all = store
        .list(&ListFilter {
            limit: 1000,
            ..ListFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 48);
    clock.advance(suite::LEASE * 2);
    assert_eq!(store.abandoned(store.now(), 1000).await.unwrap().len(), 24);
    clock.advance(idemkit_testkit::lifecycle::REAP * 2);
    let report = store
        .reap(store.now().minus(idemkit_testkit::lifecycle::REAP))
        .await
        .unwrap();
    assert_eq!(
        report,
        ReapReport {
            deleted: 24,
            moved_to_review: 24
        }
    );
    assert_eq!(store.review(1000).await.unwrap().len(), 24);
    let parked = store
        .list(&ListFilter {
            state: Some(RecordState::Parked),
            limit: 1000,
            ..ListFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(parked.len(), 24, "listed for review and kept, parked");
    assert_eq!(
        store
            .reap(store.now().minus(idemkit_testkit::lifecycle::REAP))
            .await
            .unwrap(),
        ReapReport::default()
    );
}

/// `WAIT` calls the primaries have served so far (`INFO commandstats`).
fn wait_calls(cluster: &Cluster) -> u64 {
    cluster
        .pairs()
        .iter()
        .map(|&(primary, _)| {
            info(primary, "commandstats")
                .get("cmdstat_wait")
                .and_then(|v| v.split(',').find_map(|kv| kv.strip_prefix("calls=")))
                .map_or(0, |n| n.parse::<u64>().unwrap())
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_conformance_and_concurrency_gate() {
    if !have_redis_binaries() {
        return;
    }
    let started = Instant::now();
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let urls = cluster.urls();
    eprintln!("cluster up in {:?}: {urls:?}", started.elapsed());
    assert_eq!(cluster.pairs().len(), 3, "three primaries, each with a replica");

    let passed = run_cases(&urls).await;
    assert_eq!(passed.len(), suite::cases::<RedisStore>().len());
    assert!(passed.len() >= 13, "{passed:?}");
    let passed = run_lifecycle_cases(&urls).await;
    assert_eq!(
        passed.len(),
        idemkit_testkit::lifecycle::cases::<RedisStore>().len()
    );
    assert!(passed.len() >= 12, "{passed:?}");
    spread_over_primaries(&cluster, &urls).await;
    let clock = Arc::new(ManualClock::new());
    crate::business::business_writes_are_fenced_with_the_phase(
        crate::business::Server::Cluster(urls.clone()),
        cluster_store(&urls, "business", clock.clone()).await,
        clock,
    )
    .await;

    // Records of many accounts spread over every primary; a record and its
    // channel share the account's slot.
    let probe = cluster_store(&urls, "layout", Arc::new(ManualClock::new())).await;
    let mut slots = std::collections::BTreeSet::new();
    for i in 0..32 {
        let key = probe.record_key(&scope(&format!("acct-{i}"), "k"));
        let other = probe.record_key(&scope(&format!("acct-{i}"), "another-key"));
        let slot = cluster.keyslot(&key);
        assert_eq!(slot, cluster.keyslot(&other), "one account, one slot");
        slots.insert(slot);
    }
    assert!(slots.len() > 16, "accounts spread over slots");

    // The gate: 64 identical requests at once from 8 independent store instances
    // (as 8 application processes would): one runs its side effect, every other
    // answer is in-progress, and afterwards all 64 replay the winner's response.
    let instances: Vec<Arc<RedisStore>> = {
        let prefix = unique_prefix("gate");
        let mut v = Vec::new();
        for _ in 0..8 {
            let s = RedisStore::connect_with(
                &cluster_url(&urls),
                RedisConfig::default().with_prefix(prefix.clone()),
            )
            .await
            .unwrap();
            v.push(Arc::new(s));
        }
        v
    };
    let effects = Arc::new(AtomicUsize::new(0));
    let s = scope("acct-gate", "order-confirm-42");
    let req = claim_req(&s, r#"{"sku":"A","quantity":1}"#);
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..64 {
        let (store, req, barrier, effects) = (
            instances[i % 8].clone(),
            req.clone(),
            barrier.clone(),
            effects.clone(),
        );
        set.spawn(async move {
            barrier.wait().await;
            match store.claim(&req).await.expect("claim") {
                ClaimOutcome::Claimed(lease) => {
                    effects.fetch_add(1, Ordering::SeqCst);
                    store
                        .complete(&req.scope, lease.token, &response(201, r#"{"order":1}"#))
                        .await
                        .expect("complete");
                    "claimed"
                }
                ClaimOutcome::InProgress { .. } => "in-progress",
                ClaimOutcome::Replay(r) => {
                    assert_eq!(r, response(201, r#"{"order":1}"#));
                    "replay"
                }
                other => panic!("unexpected {other:?}"),
            }
        });
    }
    let mut claimed = 0;
    while let Some(r) = set.join_next().await {
        claimed += usize::from(r.unwrap() == "claimed");
    }
    assert_eq!(claimed, 1);
    assert_eq!(effects.load(Ordering::SeqCst), 1, "one side effect");
    for store in &instances {
        assert_eq!(
            store.claim(&req).await.unwrap(),
            ClaimOutcome::Replay(response(201, r#"{"order":1}"#))
        );
    }

    // WAIT with live replicas: every write is acknowledged by one replica.
    let durable = RedisStore::connect_with(
        &cluster_url(&urls),
        RedisConfig::default()
            .with_prefix(unique_prefix("wait"))
            .with_wait_replicas(1, Duration::from_secs(2)),
    )
    .await
    .unwrap();
    let waits_before = wait_calls(&cluster);
    for i in 0..20 {
        let s = scope(&format!("acct-{i}"), "k-wait");
        let lease = suite::must_claim(&durable, &claim_req(&s, "{}")).await;
        durable
            .complete(&s, lease.token, &response(201, "w"))
            .await
            .unwrap();
        assert_eq!(
            durable.claim(&claim_req(&s, "{}")).await.unwrap(),
            ClaimOutcome::Replay(response(201, "w"))
        );
    }
    // Each claim and each completion was followed by a `WAIT` on its primary
    // (the replays write nothing and need none).
    let waits = wait_calls(&cluster) - waits_before;
    assert!(waits >= 40, "WAIT sent {waits} times for 40 writes");

    // Notifications use sharded pub/sub on the record's shard.
    let waiter = durable.clone();
    let s = scope("acct-notify", "k");
    let lease = suite::must_claim(&durable, &claim_req(&s, "{}")).await;
    let w = {
        let s = s.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            waiter.wait_for_change(&s, Duration::from_secs(20)).await.unwrap();
            t.elapsed()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    durable
        .complete(&s, lease.token, &response(201, "n"))
        .await
        .unwrap();
    let waited = w.await.unwrap();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(5),
        "woken by the completion 300 ms in, not before: {waited:?}"
    );

    drop(cluster);
    eprintln!("cluster test done in {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(60));
}
