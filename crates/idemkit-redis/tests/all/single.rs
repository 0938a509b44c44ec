//! Single-node behaviour beyond the conformance suite.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, FencingToken, KeyStore, RecordState, StoreError};
use idemkit_redis::{RedisConfig, RedisConfigError, RedisStore, ReplicaShortfall};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{LEASE, WINDOW, claim_req, must_claim, response, scope};

use crate::common::{connect_single, have_redis_binaries, redis_url, single_config};
use crate::harness::{Standalone, cli};

async fn store(tag: &str) -> Option<(RedisStore, Arc<ManualClock>)> {
    redis_url()?;
    let clock = Arc::new(ManualClock::new());
    let store = connect_single(single_config(tag)).await.expect("connect");
    Some((store.with_test_clock(clock.clone()), clock))
}

async fn pttl(_store: &RedisStore, key: &str) -> i64 {
    let client = redis::Client::open(redis_url().expect("redis url").as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("PTTL").arg(key).query_async(&mut conn).await.unwrap()
}

#[tokio::test]
async fn key_layout_is_hash_tagged_by_account() {
    let Some((store, _)) = store("layout").await else {
        return;
    };
    let prefix = store.config().key_prefix().to_owned();
    let key = store.record_key(&scope("acct-{7}", "order-1"));
    assert_eq!(key, format!("{prefix}:{{acct-%7B7%7D}}:k:order-1"));
}

/// TTL decisions: a completed or released record expires after the reap
/// threshold (never shorter than the replay window); an unfinished one (in
/// flight, abandoned, parked) never expires by TTL: its progress and intents
/// stay until it completes or an operator acts. The token high-water mark has
/// no TTL either.
#[tokio::test]
async fn ttl_keeps_unfinished_work_and_expires_finished_records_after_the_reap_threshold() {
    let Some(url) = redis_url() else { return };
    let base = single_config("ttl");
    let reap = Duration::from_secs(3600);
    let store = connect_single(base.clone().with_reap_after(reap)).await.unwrap();
    let s = scope("acct-a", "k-ttl");
    let mut req = claim_req(&s, "{}");
    req.replay_window = Duration::from_secs(600);
    let lease = must_claim(&store, &req).await;
    let key = store.record_key(&s);
    assert_eq!(pttl(&store, &key).await, -1, "in flight: no TTL");
    store.heartbeat(&s, lease.token, LEASE).await.unwrap();
    assert_eq!(pttl(&store, &key).await, -1, "heartbeat: no TTL");
    store
        .complete(&s, lease.token, &response(201, "x"))
        .await
        .unwrap();
    let done = pttl(&store, &key).await;
    assert!(done > 3_590_000 && done <= 3_600_000, "{done}");
    let mark = format!("{}:{{acct-a}}:t", base.key_prefix());
    assert_eq!(pttl(&store, &mark).await, -1, "the high-water mark never expires");

    // Released without progress: a tombstone with the reap threshold's TTL.
    let r = scope("acct-a", "k-ttl-released");
    let mut req = claim_req(&r, "{}");
    req.replay_window = Duration::from_secs(600);
    let l = must_claim(&store, &req).await;
    store.release(&r, l.token).await.unwrap();
    let released = pttl(&store, &store.record_key(&r)).await;
    assert!(released > 3_590_000 && released <= 3_600_000, "{released}");

    // Abandoned, parked: no TTL.
    let a = scope("acct-a", "k-ttl-abandoned");
    let l = must_claim(&store, &claim_req(&a, "{}")).await;
    store.abandon(&a, l.token, "courier timeout").await.unwrap();
    assert_eq!(pttl(&store, &store.record_key(&a)).await, -1, "abandoned: no TTL");
    let p = scope("acct-a", "k-ttl-parked");
    let l = must_claim(&store, &claim_req(&p, "{}")).await;
    store.park(&p, l.token, "outcome unknown").await.unwrap();
    assert_eq!(pttl(&store, &store.record_key(&p)).await, -1, "parked: no TTL");

    // A reap threshold shorter than the window would drop records that must replay.
    let short = RedisStore::connect_with(
        &url,
        RedisConfig::default()
            .with_prefix(format!("{}-short", base.key_prefix()))
            .with_reap_after(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let s2 = scope("acct-a", "k-ttl-2");
    let l2 = must_claim(&short, &claim_req(&s2, "{}")).await;
    short.complete(&s2, l2.token, &response(201, "y")).await.unwrap();
    let kept = pttl(&short, &short.record_key(&s2)).await;
    assert!(kept > (WINDOW.as_millis() as i64) - 10_000, "{kept}");
}

/// A record that expired by TTL (or was deleted any other way) and is claimed
/// again gets a token above every token it had: the account's high-water mark
/// outlives it, so a holder paused since then is fenced.
#[tokio::test]
async fn a_record_gone_by_ttl_never_restarts_its_tokens() {
    let Some((store, clock)) = store("ttl-gone").await else {
        return;
    };
    let s = scope("acct-a", "k-gone");
    let req = claim_req(&s, "{}");
    let first = must_claim(&store, &req).await;
    clock.advance(LEASE * 2);
    let second = must_claim(&store, &req).await;
    store
        .complete(&s, second.token, &response(201, "x"))
        .await
        .unwrap();
    // What a TTL expiry does.
    let client = redis::Client::open(redis_url().expect("redis url").as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(store.record_key(&s))
        .query_async(&mut conn)
        .await
        .unwrap();
    let third = must_claim(&store, &req).await;
    assert!(
        third.token > second.token && third.token > first.token,
        "{third:?}"
    );
    for stale in [first.token, second.token] {
        assert!(matches!(
            store.complete(&s, stale, &response(201, "stale")).await,
            Err(StoreError::Fenced)
        ));
    }
}

/// `discard_progress` drops the recovery point and step outputs of a record
/// nobody holds and releases it on a new token; the next request runs as a
/// first attempt. Live leases, completed and absent records are refused.
#[tokio::test]
async fn discard_progress_releases_a_parked_record_without_its_progress() {
    let Some((store, clock)) = store("discard").await else {
        return;
    };
    let s = scope("acct-a", "k-discard");
    let req = claim_req(&s, "{}");
    let l = must_claim(&store, &req).await;
    assert!(!store.discard_progress(&s).await.unwrap(), "live lease");
    store
        .record_phase(
            &s,
            l.token,
            "intent",
            Some(("courier", &serde_json::json!({"intent": "k"}))),
        )
        .await
        .unwrap();
    store.park(&s, l.token, "outcome unknown").await.unwrap();
    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Parked);
    assert!(store.discard_progress(&s).await.unwrap());
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Released);
    assert_eq!(rec.recovery_point, None);
    assert!(rec.step_outputs.is_empty());
    assert_eq!(rec.last_error.as_deref(), Some(idemkit_core::FORCE_RELEASED));
    assert!(rec.fencing_token > l.token);
    let again = must_claim(&store, &req).await;
    assert_eq!(again.resumed_from, None, "a first attempt");
    assert!(again.token > rec.fencing_token);
    store
        .complete(&s, again.token, &response(201, "x"))
        .await
        .unwrap();
    assert!(!store.discard_progress(&s).await.unwrap(), "completed");
    assert!(
        !store
            .discard_progress(&scope("acct-a", "k-absent"))
            .await
            .unwrap()
    );
    // Abandoned by a crashed holder: only once its lease has expired.
    let c = scope("acct-a", "k-discard-crashed");
    must_claim(&store, &claim_req(&c, "{}")).await;
    assert!(!store.discard_progress(&c).await.unwrap());
    clock.advance(LEASE * 2);
    assert!(store.discard_progress(&c).await.unwrap());
}

#[tokio::test]
async fn phases_are_fenced_kept_across_takeover_and_cleared_on_reuse() {
    let Some((store, clock)) = store("phases").await else {
        return;
    };
    let s = scope("acct-a", "k-phase");
    let req = claim_req(&s, r#"{"sku":"A"}"#);
    let a = must_claim(&store, &req).await;
    let label = serde_json::json!({"tracking": "1Z999", "cost": 12.5});
    store
        .record_phase(&s, a.token, "label-bought", Some(("buy_label", &label)))
        .await
        .unwrap();
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.recovery_point.as_deref(), Some("label-bought"));
    assert_eq!(rec.step_outputs.get("buy_label"), Some(&label));

    clock.advance(LEASE + Duration::from_millis(1));
    let b = must_claim(&store, &req).await;
    assert!(b.token > a.token);
    assert_eq!(b.resumed_from.as_deref(), Some("label-bought"));
    assert!(matches!(
        store.record_phase(&s, a.token, "stale", None).await,
        Err(StoreError::Fenced)
    ));
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.recovery_point.as_deref(), Some("label-bought"));
    assert_eq!(rec.step_outputs.get("buy_label"), Some(&label));

    // A release cannot wipe recorded progress: the record is abandoned instead.
    store.release(&s, b.token).await.unwrap();
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.recovery_point.as_deref(), Some("label-bought"));
    let b2 = must_claim(&store, &req).await;
    assert_eq!(
        b2.resumed_from.as_deref(),
        Some("label-bought"),
        "taken over at once"
    );
    store
        .complete(&s, b2.token, &response(201, "done"))
        .await
        .unwrap();
    // Reused after its replay window: a clean slate.
    clock.advance(WINDOW + Duration::from_secs(1));
    let c = must_claim(&store, &claim_req(&s, r#"{"sku":"B"}"#)).await;
    assert!(c.token > b2.token);
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.recovery_point, None);
    assert!(rec.step_outputs.is_empty());
    assert_eq!(rec.state, RecordState::InFlight);
}

#[tokio::test]
async fn token_of_another_record_or_a_guess_is_fenced() {
    let Some((store, _)) = store("guess").await else {
        return;
    };
    let s = scope("acct-a", "k-guess");
    let a = must_claim(&store, &claim_req(&s, "{}")).await;
    for wrong in [FencingToken(0), FencingToken(a.token.0 + 1), FencingToken(-1)] {
        assert!(matches!(
            store.complete(&s, wrong, &response(201, "x")).await,
            Err(StoreError::Fenced)
        ));
    }
    assert!(matches!(
        store.heartbeat(&scope("acct-a", "absent"), a.token, LEASE).await,
        Err(StoreError::Fenced)
    ));
}

#[tokio::test]
async fn wait_without_enough_replicas_is_unavailable_and_hands_the_key_back() {
    let Some(url) = redis_url() else { return };
    let port: u16 = url
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').split('/').next()?.parse().ok())
        .unwrap_or(6379);
    // Ask for one replica more than the server has, so the shortfall is real on
    // any test server (no skip that could hide a missing check under CI).
    let info = cli(port, &["INFO", "replication"]);
    let replicas: u32 = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("connected_slaves:"))
        .and_then(|n| n.parse().ok())
        .expect("INFO replication names connected_slaves");
    let required = replicas + 1;
    let store = connect_single(single_config("wait").with_wait_replicas(required, Duration::from_millis(50)))
        .await
        .unwrap();
    let s = scope("acct-a", "k-wait");
    let req = claim_req(&s, "{}");
    match store.claim(&req).await {
        Err(StoreError::Unavailable(e)) => {
            let short = e.downcast_ref::<ReplicaShortfall>().expect("a replica shortfall");
            assert!(short.acknowledged < required, "{short:?}");
            assert_eq!(short.required, required);
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(StoreError::Unavailable("x".into()).is_retryable());
    // The claim that did not count was released: the record behaves as absent.
    let rec = store.get(&s).await.unwrap().expect("record kept for its token");
    assert_eq!(rec.state, RecordState::Released);
}

#[tokio::test]
async fn unreachable_server_is_unavailable() {
    let port = crate::harness::free_ports(1)[0];
    let config = RedisConfig::default()
        .with_operation_timeout(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_millis(200));
    let started = Instant::now();
    match RedisStore::connect_with(&format!("redis://127.0.0.1:{port}"), config).await {
        Err(err @ StoreError::Unavailable(_)) => {
            // Printed as a chain, the cause appears once (the kind does not repeat it).
            let source = std::error::Error::source(&err).expect("the cause").to_string();
            let chain = format!("{:#}", anyhow::Error::new(err));
            assert!(chain.starts_with("key store unavailable: "), "{chain}");
            assert_eq!(chain.matches(source.as_str()).count(), 1, "{chain}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_connection_is_a_retryable_unavailable() {
    if !have_redis_binaries() {
        return;
    }
    let mut server = Standalone::start(&[]);
    let store = RedisStore::connect_with(
        &server.url(),
        RedisConfig::default()
            .with_operation_timeout(Duration::from_secs(2))
            .with_connect_timeout(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let s = scope("acct-a", "k-lost");
    let lease = must_claim(&store, &claim_req(&s, "{}")).await;
    server.node.kill();
    let started = Instant::now();
    for _ in 0..3 {
        match store.complete(&s, lease.token, &response(201, "x")).await {
            Err(e @ StoreError::Unavailable(_)) => assert!(e.is_retryable()),
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_wakes_waiters_without_polling() {
    let Some((holder, _)) = store("notify").await else {
        return;
    };
    let waiter = holder.clone();
    assert!(waiter.notifies_changes());
    let s = scope("acct-a", "k-notify");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&holder, &req).await;
    assert!(matches!(
        waiter.claim(&req).await.unwrap(),
        ClaimOutcome::InProgress { .. }
    ));
    let w = {
        let (waiter, s) = (waiter.clone(), s.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            waiter.wait_for_change(&s, Duration::from_secs(20)).await.unwrap();
            started.elapsed()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .unwrap();
    let waited = w.await.unwrap();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert_eq!(
        waiter.claim(&req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "done"))
    );
    // Already changed: no wait at all.
    let started = Instant::now();
    waiter.wait_for_change(&s, Duration::from_secs(20)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// With notifications off the store never subscribes: a wait on a live
/// in-flight record returns at once (the caller polls), where a notifying
/// store waiting on the same record, with nothing changing, waits out its
/// bound.
#[tokio::test]
async fn notifications_can_be_turned_off() {
    let Some(_) = redis_url() else { return };
    let config = single_config("quiet");
    let quiet = connect_single(config.clone().with_notifications(false))
        .await
        .unwrap();
    let notifying = connect_single(config).await.unwrap();
    assert!(!quiet.notifies_changes());
    assert!(notifying.notifies_changes());
    let s = scope("acct-a", "k-quiet");
    let lease = must_claim(&quiet, &claim_req(&s, "{}")).await;
    let bound = Duration::from_millis(700);

    let started = Instant::now();
    quiet.wait_for_change(&s, bound).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(150),
        "no subscription, no wait: {:?}",
        started.elapsed()
    );
    let rec = quiet.get(&s).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.fencing_token),
        (RecordState::InFlight, lease.token),
        "nothing changed: the wait did not end for a change"
    );

    // The control: the same wait on a store that subscribes lasts its bound.
    let started = Instant::now();
    notifying.wait_for_change(&s, bound).await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= bound - Duration::from_millis(20) && waited < bound + Duration::from_secs(2),
        "{waited:?}"
    );
}

#[test]
fn bad_configs_are_refused() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for config in [
        RedisConfig::default().with_prefix("has{brace"),
        RedisConfig::default().with_prefix(""),
        RedisConfig::default().with_wait_replicas(1, Duration::ZERO),
    ] {
        match rt.block_on(RedisStore::connect_with("redis://127.0.0.1:1", config)) {
            Err(e @ StoreError::Config(_)) => assert!(!e.is_retryable()),
            other => panic!("{other:?}"),
        }
    }
    // A URL that names no Redis server, by its scheme or its form.
    for (url, expected) in [
        (
            "http://127.0.0.1:6379",
            Some(RedisConfigError::BadUrl("http://127.0.0.1:6379".into())),
        ),
        ("", Some(RedisConfigError::NoUrl)),
        ("redis+cluster://", Some(RedisConfigError::NoUrl)),
        ("redis://127.0.0.1:notaport", None),
    ] {
        match rt.block_on(RedisStore::connect(url)) {
            Err(e @ StoreError::Config(_)) => {
                assert!(!e.is_retryable());
                let StoreError::Config(source) = &e else {
                    unreachable!()
                };
                if let Some(expected) = expected {
                    assert_eq!(
                        source.downcast_ref::<RedisConfigError>(),
                        Some(&expected),
                        "{url}"
                    );
                }
            }
            other => panic!("{url:?}: {other:?}"),
        }
    }
}
