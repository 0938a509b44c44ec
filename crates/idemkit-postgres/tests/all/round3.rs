//! Hardening round three (issue 30) on PostgreSQL: the reaper's review entry
//! under a concurrent holder (item 4), the single-step isolation level
//! (item 11), and a lease-mode claim whose reply is lost (item 5). Each test
//! fails on the code before its fix.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{
    Clock, KeyStore, PhaseUpdate, RecordState, TransactionalStore,
};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{LEASE, claim_req, must_claim, scope};
use sqlx::PgPool;

use crate::store_in_fresh_schema;

/// Waits until some backend is blocked by backend `pid` (a lock wait), as
/// PostgreSQL itself reports it: the test's next step then happens while the
/// waiter is known to be waiting, not after a sleep that hopes so.
pub(crate) async fn wait_until_blocked_by(pool: &PgPool, pid: i32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(pid)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nobody blocked on backend {pid} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Item 4. A lapsed holder commits a phase (an external call's intent) while
/// the reaper waits on the record's row lock: the reaper parks the record as
/// it is after that commit, and its review entry must say the same (the
/// recovery point and the intent), or an operator trusting the review list
/// would declare "the downstream did nothing" and cause a second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_review_entry_is_the_record_the_reaper_parked() {
    let clock = Arc::new(ManualClock::new());
    let Some(store) = store_in_fresh_schema(Some(clock.clone())).await else {
        return;
    };
    let s = scope("a", "reap-race");
    let holder = must_claim(&*store, &claim_req(&s, "{}")).await;
    clock.advance(LEASE * 2); // the holder's lease lapsed; it still runs

    // Session A: the holder's phase, its row lock held, not committed yet.
    let mut a = store.begin_fenced(&s, holder.token).await.unwrap();
    let a_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *a)
        .await
        .unwrap();
    let intent = serde_json::json!({"intent": "book", "downstream_key": "k-1"});
    store
        .advance_in_tx(
            &mut a,
            &s,
            holder.token,
            &PhaseUpdate {
                recovery_point: "courier-intent".into(),
                step: Some(("courier".into(), intent.clone())),
            },
        )
        .await
        .unwrap();

    // The reaper, in another session, waits on A's row lock.
    let before = clock.now().plus(Duration::from_secs(1));
    let reaper = tokio::spawn({
        let store = store.clone();
        async move { store.reap(before).await }
    });
    wait_until_blocked_by(store.pool(), a_pid).await;
    TransactionalStore::commit(&*store, a).await.expect("A commits its phase");
    let report = reaper.await.unwrap().expect("the reaper's pass");
    assert_eq!(report.moved_to_review, 1, "{report:?}");

    let parked = store.get(&s).await.unwrap().unwrap();
    assert_eq!(parked.state, RecordState::Parked);
    assert_eq!(parked.recovery_point.as_deref(), Some("courier-intent"));
    let review = store.review(10).await.unwrap();
    assert_eq!(review.len(), 1, "{review:?}");
    let entry = &review[0];
    assert_eq!(
        (entry.recovery_point.as_deref(), &entry.step_outputs),
        (Some("courier-intent"), &parked.step_outputs),
        "the review entry is the record as parked, with A's committed intent"
    );
    assert_eq!(entry.step_outputs.get("courier"), Some(&intent));
    assert_eq!(entry.state, RecordState::InFlight, "the state it was in");
}
