//! Business data in Redis, written with the phase advance in one fenced
//! script (`RedisStore::advance_with`): all or nothing, never by a stale
//! holder, only in the account's cluster slot. Run on a single node here and
//! on the real cluster by `cluster.rs`.

use std::sync::Arc;

use idemkit_core::{ClaimOutcome, KeyStore, PhaseUpdate, StoreError};
use idemkit_redis::{RedisStore, RedisWrite};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{LEASE, claim_req, must_claim, scope};

use crate::common::{redis_url, single_config};

/// Runs `cmd` on the store's server (a cluster client when the store is one).
async fn query(store: &RedisStore, cmd: &redis::Cmd) -> redis::Value {
    let config = store.config();
    if config.cluster {
        let client = redis::cluster::ClusterClient::new(config.urls.clone()).unwrap();
        let mut conn = client.get_async_connection().await.unwrap();
        cmd.query_async(&mut conn).await.unwrap()
    } else {
        let client = redis::Client::open(config.urls[0].as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        cmd.query_async(&mut conn).await.unwrap()
    }
}

async fn get(store: &RedisStore, key: &str) -> Option<String> {
    match query(store, redis::cmd("GET").arg(key)).await {
        redis::Value::Nil => None,
        v => Some(redis::from_redis_value(v).unwrap()),
    }
}

async fn hget(store: &RedisStore, key: &str, field: &str) -> Option<String> {
    match query(store, redis::cmd("HGET").arg(key).arg(field)).await {
        redis::Value::Nil => None,
        v => Some(redis::from_redis_value(v).unwrap()),
    }
}

fn update(point: &str) -> PhaseUpdate {
    PhaseUpdate {
        recovery_point: point.into(),
        step: Some((point.into(), serde_json::json!({ "at": point }))),
    }
}

/// The whole case, on any Redis deployment.
pub(crate) async fn business_writes_are_fenced_with_the_phase(
    store: Arc<RedisStore>,
    clock: Arc<ManualClock>,
) {
    let s = scope("biz-account", "order-1");
    let order = store.business_key(&s.account, "order:1");
    let stock = store.business_key(&s.account, "stock:BOOK-1");
    let first = must_claim(&*store, &claim_req(&s, "body")).await;
    store
        .advance_with(
            &s,
            first.token,
            &update("reserved"),
            &[
                RedisWrite::hset(order.clone(), "status", "reserved"),
                RedisWrite::incr_by(stock.clone(), -1),
            ],
        )
        .await
        .expect("the phase and its writes");
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("reserved"));
    assert_eq!(hget(&store, &order, "status").await.as_deref(), Some("reserved"));
    assert_eq!(get(&store, &stock).await.as_deref(), Some("-1"));

    // A write that does not fit its key's type: nothing at all is written.
    let note = store.business_key(&s.account, "note");
    let refused = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[
                RedisWrite::set(note.clone(), "charged"),
                RedisWrite::incr_by(order.clone(), 1), // a hash, not a counter
            ],
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");
    assert_eq!(get(&store, &note).await, None, "no write of a refused advance");
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("reserved"));

    // A key outside the account's slot is refused before anything is sent.
    let foreign = store.business_key(&scope("another-account", "x").account, "stock:BOOK-1");
    let refused = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[RedisWrite::incr_by(foreign.clone(), -1)],
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");
    assert_eq!(get(&store, &foreign).await, None);
    let refused = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[RedisWrite::set("plain-key".into(), "x")],
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");

    // The lease lapses and a retry takes over: the stale holder's phase and
    // its writes are refused together.
    clock.advance(LEASE * 2);
    let ClaimOutcome::Claimed(second) = store.claim(&claim_req(&s, "body")).await.unwrap() else {
        panic!("the retry takes over")
    };
    assert_eq!(second.resumed_from.as_deref(), Some("reserved"));
    let stale = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[
                RedisWrite::incr_by(stock.clone(), -1),
                RedisWrite::del(order.clone()),
            ],
        )
        .await;
    assert!(matches!(stale, Err(StoreError::Fenced)), "{stale:?}");
    assert_eq!(
        get(&store, &stock).await.as_deref(),
        Some("-1"),
        "the stale decrement never applied"
    );
    assert_eq!(hget(&store, &order, "status").await.as_deref(), Some("reserved"));
    // The new holder's own phase goes through.
    store
        .advance_with(
            &s,
            second.token,
            &update("charged"),
            &[
                RedisWrite::hset(order.clone(), "status", "charged"),
                RedisWrite::sadd(store.business_key(&s.account, "charged"), "order:1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(hget(&store, &order, "status").await.as_deref(), Some("charged"));
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("charged"));
    assert!(record.step_outputs.contains_key("charged"));
}

#[tokio::test]
async fn business_writes_on_a_single_node() {
    if redis_url().is_none() {
        return;
    }
    let clock = Arc::new(ManualClock::new());
    let store = RedisStore::connect(single_config("business"))
        .await
        .unwrap()
        .with_test_clock(clock.clone());
    business_writes_are_fenced_with_the_phase(Arc::new(store), clock).await;
}
