//! Hardening round three (issue 30) on PostgreSQL: the reaper's review entry
//! under a concurrent holder (item 4), the single-step isolation level
//! (item 11), and a lease-mode claim whose reply is lost (item 5). Each test
//! fails on the code before its fix.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{
    ClaimOutcome, Clock, KeyStore, PhaseUpdate, RecordState, StoreError, TransactionalStore, TxClaim,
};
use idemkit_postgres::{Isolation, PgConfig, PgStore, PgTx};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{LEASE, claim_req, must_claim, response, scope};
use sqlx::PgPool;

use crate::store_in_fresh_schema;

/// Waits until some backend is blocked by backend `pid` (a lock wait), as
/// PostgreSQL itself reports it: the test's next step then happens while the
/// waiter is known to be waiting, not after a sleep that hopes so.
pub(crate) async fn wait_until_blocked_by(pool: &PgPool, pid: i32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
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
    TransactionalStore::commit(&*store, a)
        .await
        .expect("A commits its phase");
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

/// A store in a fresh schema with the `biz` table, single-step transactions
/// at `isolation`, on a pool whose connections default to
/// `default_isolation` (the database's or role's setting, as
/// `default_transaction_isolation` gives it).
async fn store_at(isolation: Isolation, default_isolation: &str) -> Option<Arc<PgStore>> {
    use std::str::FromStr;
    let url = crate::database_url()?;
    let schema = crate::fresh_schema();
    let options = sqlx::postgres::PgConnectOptions::from_str(&url)
        .unwrap()
        .options([
            ("search_path", format!("{schema}, public")),
            ("default_transaction_isolation", default_isolation.to_owned()),
        ]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect_with(options)
        .await
        .unwrap();
    let config = PgConfig::default()
        .with_schema(schema)
        .with_single_step_isolation(isolation);
    let store = PgStore::from_pool(pool, config).await.unwrap();
    sqlx::query("CREATE TABLE biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    Some(Arc::new(store))
}

async fn isolation_of(tx: &mut PgTx) -> String {
    sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}

async fn biz_count(store: &PgStore, tag: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM biz WHERE tag = $1")
        .bind(tag)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

fn claimed(claim: TxClaim<PgTx>) -> (PgTx, idemkit_core::Lease) {
    match claim {
        TxClaim::Claimed { tx, lease } => (tx, lease),
        TxClaim::Other(other) => panic!("expected a claim, got {other:?}"),
    }
}

/// Item 11. The handler's transaction runs at the configured level: READ
/// COMMITTED by default (also on a database whose default is SERIALIZABLE, as
/// before), the level asked for otherwise, or the connection's own default
/// with `DatabaseDefault`; both openings (a first attempt, and a key with a
/// record to move) and a completion at that level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_step_transactions_run_at_the_configured_isolation() {
    for (isolation, default, expected) in [
        (Isolation::ReadCommitted, "read committed", "read committed"),
        (Isolation::ReadCommitted, "serializable", "read committed"),
        (Isolation::RepeatableRead, "read committed", "repeatable read"),
        (Isolation::Serializable, "read committed", "serializable"),
        (Isolation::DatabaseDefault, "serializable", "serializable"),
        (Isolation::DatabaseDefault, "read committed", "read committed"),
    ] {
        let Some(store) = store_at(isolation, default).await else {
            return;
        };
        let what = format!("{isolation:?} on a database defaulting to {default}");
        let s = scope("a", "isolation");
        // A first attempt (the opening checks absence).
        let (mut tx, lease) = claimed(store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap());
        assert_eq!(isolation_of(&mut tx).await, expected, "{what}: first attempt");
        store.release(&s, lease.token).await.ok();
        store.rollback_tx(tx).await;
        // A released key (a record to move, read under the lock).
        let lease = must_claim(&*store, &claim_req(&s, "{}")).await;
        store.release(&s, lease.token).await.unwrap();
        let (mut tx, lease) = claimed(store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap());
        assert_eq!(isolation_of(&mut tx).await, expected, "{what}: a moved record");
        sqlx::query("INSERT INTO biz (tag) VALUES ('iso')")
            .execute(&mut *tx)
            .await
            .unwrap();
        store
            .complete_in_tx(tx, &s, lease.token, &response(201, "done"))
            .await
            .unwrap_or_else(|e| panic!("{what}: completes: {e}"));
        assert_eq!(biz_count(&store, "iso").await, 1, "{what}");
    }
}

/// Item 11, the loser of a race under the snapshot levels. A duplicate that
/// waits for the key's lock (in-flight = wait) while the winner runs must
/// replay the winner once it commits: its snapshot is taken after the lock
/// is granted, so it never runs its handler on a read that misses the
/// winner's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_replays_the_winner_under_snapshot_isolation() {
    for isolation in [Isolation::RepeatableRead, Isolation::Serializable] {
        let Some(store) = store_at(isolation, "read committed").await else {
            return;
        };
        let s = scope("a", "iso-race");
        let (mut winner, lease) = claimed(store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap());
        let winner_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *winner)
            .await
            .unwrap();
        sqlx::query("INSERT INTO biz (tag) VALUES ('race')")
            .execute(&mut *winner)
            .await
            .unwrap();
        let loser = tokio::spawn({
            let store = store.clone();
            let mut req = claim_req(&s, "{}");
            req.lock_wait = Duration::from_secs(10);
            async move { store.claim_in_tx(&req).await }
        });
        wait_until_blocked_by(store.pool(), winner_pid).await;
        // A duplicate that does not wait (in-flight = reject) is told "in progress".
        assert!(
            matches!(
                store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap(),
                TxClaim::Other(ClaimOutcome::InProgress { .. })
            ),
            "{isolation:?}: a duplicate while the winner runs"
        );
        let done = response(201, "the winner's");
        store
            .complete_in_tx(winner, &s, lease.token, &done)
            .await
            .unwrap();
        match loser.await.unwrap().expect("the loser's claim") {
            TxClaim::Other(outcome) => assert_eq!(
                outcome,
                ClaimOutcome::Replay(done),
                "{isolation:?}: the loser replays"
            ),
            TxClaim::Claimed { .. } => panic!(
                "{isolation:?}: the loser claimed a key the winner completed (its snapshot missed the winner)"
            ),
        }
        assert_eq!(biz_count(&store, "race").await, 1, "{isolation:?}");
    }
}

/// Item 11: a race the lock does not cover. A lease-mode claim of the same
/// key commits while a single-step claim runs at a snapshot level; the
/// single-step commit is refused (PostgreSQL's serialization failure), its
/// writes roll back, and the store answers `Conflict` (the engine then
/// answers as the key answers: in progress, retryable), not an error the
/// engine would turn into a 503 or a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_step_commit_refused_by_a_serialization_failure_is_a_conflict() {
    for isolation in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
        let Some(store) = store_at(isolation, "read committed").await else {
            return;
        };
        let s = scope("a", "iso-lease-race");
        let (mut tx, lease) = claimed(store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap());
        sqlx::query("INSERT INTO biz (tag) VALUES ('refused')")
            .execute(&mut *tx)
            .await
            .unwrap();
        must_claim(&*store, &claim_req(&s, "{}")).await;
        let refused = store
            .complete_in_tx(tx, &s, lease.token, &response(201, "late"))
            .await;
        assert!(
            matches!(refused, Err(StoreError::Conflict)),
            "{isolation:?}: {refused:?}"
        );
        assert_eq!(biz_count(&store, "refused").await, 0, "{isolation:?}");
    }
}

const REPLY_LOST: &str = "idemkit_postgres::claim::reply_lost";
const MOVE_REPLY_LOST: &str = "idemkit_postgres::claim::move_reply_lost";

/// Item 5 (the store's half). A lease-mode claim whose write committed but
/// whose reply was lost (the connection dropped after the commit) is
/// recognised by its attempt id on a fresh connection and answered as
/// claimed: the key is held by the caller, who completes it, instead of by
/// nobody for a whole lease (`409 in progress` to every retry). Both writes a
/// claim can make: the insert of an absent key, and the move of a takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_is_recognised_by_its_attempt() {
    let clock = Arc::new(ManualClock::new());
    let Some(store) = store_in_fresh_schema(Some(clock.clone())).await else {
        return;
    };
    // A first attempt (the insert).
    let s = scope("a", "reply-lost-insert");
    fail::cfg(REPLY_LOST, &format!("return({})", s.key.as_str())).unwrap();
    let outcome = store.claim(&claim_req(&s, "{}")).await;
    fail::remove(REPLY_LOST);
    let lease = match outcome {
        Ok(ClaimOutcome::Claimed(lease)) => lease,
        other => panic!("the lost reply of a committed claim: {other:?}"),
    };
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.fencing_token),
        (RecordState::InFlight, lease.token)
    );
    assert_eq!(lease.expires_at, rec.lease_expires_at);
    assert_eq!(lease.resumed_from, None);
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .expect("the caller holds the key it claimed");

    // A takeover (the move) of a record with progress.
    let s = scope("a", "reply-lost-takeover");
    let first = must_claim(&*store, &claim_req(&s, "{}")).await;
    store
        .advance(
            &s,
            first.token,
            &PhaseUpdate {
                recovery_point: "charged".into(),
                step: None,
            },
        )
        .await
        .unwrap();
    clock.advance(LEASE * 2);
    fail::cfg(MOVE_REPLY_LOST, &format!("return({})", s.key.as_str())).unwrap();
    let outcome = store.claim(&claim_req(&s, "{}")).await;
    fail::remove(MOVE_REPLY_LOST);
    let lease = match outcome {
        Ok(ClaimOutcome::Claimed(lease)) => lease,
        other => panic!("the lost reply of a committed takeover: {other:?}"),
    };
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.fencing_token, lease.token);
    assert!(lease.token > first.token);
    assert_eq!(lease.resumed_from.as_deref(), Some("charged"));
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .expect("the caller holds the key it took over");
}

/// Item 5: an attempt id is no licence. A claim whose statement failed
/// before it committed (nothing written) is still an error, and a record
/// another attempt claimed is not taken for ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_of_a_claim_that_did_not_claim_is_not_a_claim() {
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let s = scope("a", "reply-lost-in-progress");
    let holder = must_claim(&*store, &claim_req(&s, "{}")).await;
    // The duplicate's move never happens (the lease is alive): its statement
    // is the insert that did nothing; its reply is lost.
    fail::cfg(REPLY_LOST, &format!("return({})", s.key.as_str())).unwrap();
    let outcome = store.claim(&claim_req(&s, "{}")).await;
    fail::remove(REPLY_LOST);
    assert!(
        matches!(outcome, Err(StoreError::Unavailable(_))),
        "not claimed: {outcome:?}"
    );
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.fencing_token, holder.token, "the holder still holds it");
}

/// Item 11: the session-level lock a snapshot-level opening takes before
/// `BEGIN` never outlives a failed opening. The opening fails between its
/// two round trips (holding the session lock, no transaction yet); its
/// connection is closed, not pooled, so the next claim of the key finds the
/// lock free instead of "in progress" forever on a pooled connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_snapshot_level_opening_frees_the_keys_lock() {
    const AFTER_SESSION_LOCK: &str = "idemkit_postgres::claim::after_session_lock";
    let Some(store) = store_at(Isolation::RepeatableRead, "read committed").await else {
        return;
    };
    let s = scope("a", "iso-session-lock");
    fail::cfg(AFTER_SESSION_LOCK, &format!("return({})", s.key.as_str())).unwrap();
    let failed = store.claim_in_tx(&claim_req(&s, "{}")).await;
    fail::remove(AFTER_SESSION_LOCK);
    assert!(
        matches!(failed, Err(StoreError::Unavailable(_))),
        "the opening failed: {failed:?}"
    );
    // Another instance (its own pool, so another backend: the session that
    // holds an advisory lock would be granted it again).
    let url = crate::database_url().unwrap();
    let other = PgStore::connect_with(
        &url,
        PgConfig::default()
            .with_schema(store.config().schema())
            .with_max_connections(2)
            .with_single_step_isolation(Isolation::RepeatableRead),
    )
    .await
    .unwrap();
    // The closed connection's backend ends as soon as the server reads the
    // close: a short bound for that, where a pooled connection would hold
    // the lock for good.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let (tx, lease) = loop {
        match other.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() {
            TxClaim::Claimed { tx, lease } => break (tx, lease),
            TxClaim::Other(outcome) if tokio::time::Instant::now() < deadline => {
                let _ = outcome;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            TxClaim::Other(outcome) => {
                panic!("the key's lock outlived the failed opening: {outcome:?}")
            }
        }
    };
    other
        .complete_in_tx(tx, &s, lease.token, &response(201, "done"))
        .await
        .unwrap();
}

/// Waits until at least `n` reaper passes of this schema wait on a lock (on
/// backend `pid`, or on each other: the second waits behind the first).
async fn wait_until_reapers_blocked(pool: &PgPool, pid: i32, n: i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE cardinality(pg_blocking_pids(pid)) > 0 \
             AND query LIKE '%locked AS (SELECT%' \
             AND ($1 = ANY(pg_blocking_pids(pid)) OR EXISTS (SELECT 1 FROM pg_stat_activity o \
             WHERE o.pid = ANY(pg_blocking_pids(pg_stat_activity.pid)) AND $1 = ANY(pg_blocking_pids(o.pid))))",
        )
        .bind(pid)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} backends not blocked on backend {pid} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Review (after issue 30): two reapers (two instances' completers) whose
/// passes overlap on one lapsed record. Both wait on the record's row lock;
/// the first parks it and files its review entry; the second, re-checking the
/// row after the first committed, must not park it again and file a second
/// entry (a copy of the already-parked row, whose `last_error` is the
/// reaper's own "moved to review", not the holder's error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_reaper_passes_file_one_review_entry() {
    let clock = Arc::new(ManualClock::new());
    let Some(store) = store_in_fresh_schema(Some(clock.clone())).await else {
        return;
    };
    let s = scope("a", "reap-twice");
    let holder = must_claim(&*store, &claim_req(&s, "{}")).await;
    clock.advance(LEASE * 2);

    // A lapsed holder's phase holds the row lock while both passes start.
    let mut a = store.begin_fenced(&s, holder.token).await.unwrap();
    let a_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *a)
        .await
        .unwrap();
    store
        .advance_in_tx(
            &mut a,
            &s,
            holder.token,
            &PhaseUpdate {
                recovery_point: "courier-intent".into(),
                step: None,
            },
        )
        .await
        .unwrap();
    let before = clock.now().plus(Duration::from_secs(1));
    let reap = || {
        let store = store.clone();
        tokio::spawn(async move { store.reap(before).await })
    };
    let (first, second) = (reap(), reap());
    wait_until_reapers_blocked(store.pool(), a_pid, 2).await;
    TransactionalStore::commit(&*store, a).await.unwrap();
    let moved = first.await.unwrap().expect("first pass").moved_to_review
        + second.await.unwrap().expect("second pass").moved_to_review;

    let review = store.review(10).await.unwrap();
    assert_eq!(review.len(), 1, "one lapsed record, filed twice: {review:?}");
    assert_eq!(moved, 1, "the record was parked by both passes");
}

/// A TCP proxy in front of PostgreSQL whose client-side connections can be cut
/// while the server side stays open: the server's backend keeps running the
/// statement it received, as when the network between client and server
/// fails (the server notices only when it next writes, or never).
struct CuttableProxy {
    port: u16,
    clients: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    /// Server-side sockets of cut connections, kept open until the test ends.
    kept: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl CuttableProxy {
    fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let clients = Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c, k) = (clients.clone(), kept.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(upstream) else {
                    return;
                };
                c.lock().unwrap().push(client.try_clone().unwrap());
                k.lock().unwrap().push(server.try_clone().unwrap());
                let (mut c1, mut s1) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c1, &mut s1);
                });
                let (mut c2, mut s2) = (client, server);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s2, &mut c2);
                });
            }
        });
        Self { port, clients, kept }
    }

    /// Cuts every client-side connection open now (later ones work).
    fn cut(&self) {
        for c in self.clients.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        for s in self.kept.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Review (after issue 30, item 5): a takeover's move waits on the record's
/// row lock (a lapsed holder's transaction), and the client's connection
/// breaks meanwhile. The server's backend still runs the move, and commits it
/// once the lock is free. The claim's re-read on a fresh connection must see
/// that outcome, not the row as it was before the move (then the claim answers
/// an error while its own attempt holds the key, and every retry is told
/// "in progress" for a lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_cut_off_while_its_move_waits_is_recognised() {
    let Some(url) = crate::database_url() else { return };
    let clock = Arc::new(ManualClock::new());
    // The URL's host and port, replaced by the proxy's.
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hostport = rest.split(['/', '?']).next().unwrap().to_owned();
    let upstream = if hostport.contains(':') {
        hostport.clone()
    } else {
        format!("{hostport}:5432")
    };
    let upstream = std::net::ToSocketAddrs::to_socket_addrs(&upstream)
        .unwrap()
        .next()
        .unwrap();
    let proxy = CuttableProxy::start(upstream);
    let proxied = url.replacen(&hostport, &format!("127.0.0.1:{}", proxy.port), 1);
    let config = PgConfig::default()
        .with_schema(crate::fresh_schema())
        .with_max_connections(8)
        // Every acquire checks its connection: the cut ones are replaced.
        .with_ping_if_idle_for(Duration::ZERO);
    let schema = config.schema().to_owned();
    let store = Arc::new(
        PgStore::connect_with(&proxied, config)
            .await
            .unwrap()
            .with_test_clock(clock.clone()),
    );
    let s = scope("a", "cut-while-moving");
    let first = must_claim(&*store, &claim_req(&s, "{}")).await;
    clock.advance(LEASE * 2);

    // A lapsed holder's transaction holds the row lock (directly, not proxied).
    let direct = PgPool::connect(&url).await.unwrap();
    let mut holder = direct.begin().await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {schema}.idemkit_keys WHERE idem_key = $1 FOR UPDATE"
    )))
    .bind(s.key.as_str())
    .fetch_one(&mut *holder)
    .await
    .unwrap();

    let claim = tokio::spawn({
        let store = store.clone();
        let req = claim_req(&s, "{}");
        async move { store.claim(&req).await }
    });
    wait_until_blocked_by(&direct, holder_pid).await;
    proxy.cut();
    // The claim settles at once (unfixed), or its re-read waits behind the move.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
                .bind(holder_pid)
                .fetch_one(&direct)
                .await
                .unwrap();
        let behind_move: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE cardinality(pg_blocking_pids(pid)) > 0 \
             AND NOT ($1 = ANY(pg_blocking_pids(pid)))",
        )
        .bind(holder_pid)
        .fetch_one(&direct)
        .await
        .unwrap();
        if claim.is_finished() || behind_move > 0 || waiting >= 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "neither settled nor waiting"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    holder.commit().await.unwrap();
    let outcome = claim.await.unwrap();

    let rec = store.get(&s).await.unwrap().unwrap();
    assert!(
        rec.fencing_token > first.token,
        "the cut-off move committed: {rec:?}"
    );
    let lease = match outcome {
        Ok(ClaimOutcome::Claimed(lease)) => lease,
        other => panic!(
            "the move committed after the connection broke, and the claim answered {other:?} \
             (the key is held by its attempt for a lease)"
        ),
    };
    assert_eq!(lease.token, rec.fencing_token);
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .expect("the caller holds the key its cut-off move took");
}
