//! Regression tests for PostgreSQL-specific interleavings (SPEC §3): each
//! fails on the code before its fix.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore, RecordState, SystemClock, TransactionalStore, TxClaim};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_testkit::ManualClock;
use idemkit_testkit::SkewedClock;
use idemkit_testkit::suite::{LEASE, claim_req, must_claim, response, scope};

use crate::{database_url, fresh_schema, store_in_fresh_schema};

const BEFORE_MOVE: &str = "idemkit_postgres::claim::before_move";

/// A takeover is one compare on state, lease and token: a lapsed holder that
/// completes between the retry's read (lease expired) and its takeover write is
/// replayed, never reopened and run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completion_between_the_takeover_read_and_write_is_never_reopened() {
    let clock = Arc::new(ManualClock::new());
    let Some(store) = store_in_fresh_schema(Some(clock.clone())).await else {
        return;
    };
    let s = scope("a", "lapsed");
    let req = claim_req(&s, "{}");
    let holder = must_claim(&*store, &req).await;
    clock.advance(LEASE * 2); // the holder's heartbeats failed: its lease lapsed

    // The retry pauses between its read and its compare-and-swap.
    static RETRY_TASK: OnceLock<tokio::task::Id> = OnceLock::new();
    let (hit_tx, hit_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (hit_tx, go_rx) = (Mutex::new(hit_tx), Mutex::new(go_rx));
    fail::cfg_callback(BEFORE_MOVE, move || {
        if tokio::task::try_id().is_some() && tokio::task::try_id() == RETRY_TASK.get().copied() {
            let _ = hit_tx.lock().unwrap().send(());
            // Hand this worker's queued tasks to another thread while parked.
            tokio::task::block_in_place(|| go_rx.lock().unwrap().recv()).ok();
        }
    })
    .unwrap();
    let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
    let retry = tokio::spawn({
        let (store, req) = (store.clone(), req.clone());
        async move {
            gate_rx.await.unwrap();
            store.claim(&req).await
        }
    });
    RETRY_TASK.set(retry.id()).unwrap();
    gate_tx.send(()).unwrap();
    tokio::task::spawn_blocking(move || hit_rx.recv_timeout(Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("the retry reached its takeover write");

    let done = response(201, "the lapsed holder's");
    store
        .complete(&s, holder.token, &done)
        .await
        .expect("the holder completes");
    go_tx.send(()).unwrap();
    let outcome = retry.await.unwrap().expect("claim");
    fail::remove(BEFORE_MOVE);
    assert_eq!(
        outcome,
        ClaimOutcome::Replay(done.clone()),
        "replayed, not reopened"
    );
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.response, Some(done));
}

/// An instance whose own clock runs well ahead still sees a live lease as
/// live: leases are judged by the database's clock.
#[tokio::test]
async fn a_skewed_instance_cannot_take_over_a_live_lease() {
    let Some(url) = database_url() else { return };
    let config = || PgConfig::default().with_schema("skew_".to_owned() + &fresh_schema()[2..]);
    let first = config();
    let honest = PgStore::connect_with(&url, first.clone()).await.unwrap();
    let ahead = Arc::new(SkewedClock {
        base: Arc::new(SystemClock),
        ahead: LEASE + Duration::from_secs(25),
    });
    let skewed = PgStore::connect_with(&url, first)
        .await
        .unwrap()
        .with_clock(ahead);
    let s = scope("a", "skew");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&honest, &req).await;
    match skewed.claim(&req).await.unwrap() {
        ClaimOutcome::InProgress { retry_after } => {
            assert!(retry_after > LEASE - Duration::from_secs(5), "{retry_after:?}")
        }
        other => panic!("a skewed instance took over a live lease: {other:?}"),
    }
    honest
        .complete(&s, lease.token, &response(201, "mine"))
        .await
        .unwrap();
}

/// A single-step claim that reuses or takes over a row lifts its short
/// `lock_timeout` before the handler's statements run, as the insert path does.
#[tokio::test]
async fn single_step_reuse_lifts_the_claims_lock_timeout() {
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let s = scope("a", "lock-timeout");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&*store, &req).await;
    store.release(&s, lease.token).await.unwrap();
    let TxClaim::Claimed { mut tx, .. } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("a released key is claimed again");
    };
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(
        timeout, "0",
        "the handler's statements must not inherit the claim's lock wait"
    );
}

/// `from_pool` checks the schema name before formatting it into SQL.
#[tokio::test]
async fn from_pool_refuses_a_schema_name_that_is_not_an_identifier() {
    let Some(url) = database_url() else { return };
    let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy(&url).unwrap();
    let config = PgConfig::default().with_schema("x; DROP TABLE y");
    let err = PgStore::from_pool(pool, config).await.unwrap_err();
    match &err {
        idemkit_core::StoreError::Config(source) => {
            assert!(source.to_string().contains("must match"), "{source}")
        }
        other => panic!("not a configuration error: {other:?}"),
    }
}

/// A waiter whose record completed between the caller's claim and its waiter
/// flag returns at once instead of waiting out its bound.
#[tokio::test]
async fn a_waiter_on_a_record_that_already_completed_returns_at_once() {
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let s = scope("a", "late-waiter");
    let lease = must_claim(&*store, &claim_req(&s, "{}")).await;
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .unwrap();
    let started = Instant::now();
    store.wait_for_change(&s, Duration::from_secs(5)).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "waited {:?}",
        started.elapsed()
    );
}
