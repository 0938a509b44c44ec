//! Single-step mode claims with the key's advisory lock and a read, and writes
//! the record with the `COMMIT` in one round trip (a simple query, values as
//! hex literals). These pin what that must keep: the stored answer byte for
//! byte, nothing committed when the record cannot be written, and a connection that goes back to the
//! pool outside any transaction with sqlx's savepoint bookkeeping intact. Also
//! the pool's liveness check, which the single-step path's round-trip budget
//! shapes.

use std::sync::Arc;

use idemkit_core::{
    ClaimOutcome, FencingToken, KeyStore, RecordState, StoreError, StoredHeader, StoredResponse,
    TransactionalStore, TxClaim,
};
use idemkit_postgres::{PROVISIONAL_TOKEN, PgConfig, PgStore};
use idemkit_testkit::suite::{claim_req, response, scope};
use sqlx::Connection;

use crate::{database_url, fresh_schema};

async fn one_connection_store() -> Option<(String, Arc<PgStore>)> {
    let url = database_url()?;
    let store = one_connection_instance(&url, fresh_schema()).await;
    sqlx::query("CREATE TABLE biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    Some((url, Arc::new(store)))
}

/// An instance whose pool has one connection besides the notification listener's.
async fn one_connection_instance(url: &str, schema: String) -> PgStore {
    let config = PgConfig::default().with_schema(schema).with_max_connections(2);
    PgStore::connect_with(url, config).await.expect("connect")
}

/// A store in a fresh schema (with the `biz` table) whose pool holds each
/// released connection for 300 ms before its release check: a transaction
/// merely dropped keeps its locks that long (its `ROLLBACK` rides on that
/// check), one rolled back explicitly does not. Tests of "rolled back before
/// returning" fail against a drop, deterministically.
async fn slow_release_store() -> Option<(String, PgStore)> {
    use std::str::FromStr;
    let url = database_url()?;
    let schema = fresh_schema();
    let options = sqlx::postgres::PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", format!("{schema}, public"))]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .after_release(|_, _| {
            Box::pin(async {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                Ok(true)
            })
        })
        .connect_with(options)
        .await
        .unwrap();
    let config = PgConfig::default().with_schema(schema).with_max_connections(2);
    let store = PgStore::from_pool(pool, config).await.unwrap();
    sqlx::query("CREATE TABLE biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    Some((url, store))
}

/// Another instance on the same store (its own pool), as a second process would be.
async fn another_instance(url: &str, schema: String) -> PgStore {
    let config = PgConfig::default().with_schema(schema);
    PgStore::connect_with(url, config).await.expect("connect")
}

/// The schema `e` works in (the store's: the head of its pool's `search_path`).
async fn schema_of<'e>(e: impl sqlx::PgExecutor<'e>) -> String {
    sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(e)
        .await
        .unwrap()
}

/// A business row, written through `e`.
async fn insert_tag<'e>(e: impl sqlx::PgExecutor<'e>, tag: &str) {
    sqlx::query("INSERT INTO biz (tag) VALUES ($1)")
        .bind(tag)
        .execute(e)
        .await
        .unwrap();
}

async fn tags(store: &PgStore) -> Vec<String> {
    sqlx::query_scalar("SELECT tag FROM biz ORDER BY tag")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

/// Every byte value, quotes, backslashes and a NUL-free non-ASCII header
/// survive the literal encoding; the record is completed with them.
#[tokio::test]
async fn the_fused_completion_stores_the_answer_byte_for_byte() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let s = scope("acct'; DROP TABLE biz; -- \\' \t", "fused-bytes");
    let TxClaim::Claimed { tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    let response = StoredResponse {
        status: 299,
        headers: vec![StoredHeader {
            name: "x-odd".into(),
            value: "it's \\ \"quoted\" ünïcode $$ E'x'".as_bytes().to_vec(),
        }],
        body: (0..=255u8).collect(),
    };
    store
        .complete_in_tx(tx, &s, lease.token, &response)
        .await
        .unwrap();
    let rec = store.get(&s).await.unwrap().expect("stored");
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.response.as_ref(), Some(&response));
    assert!(
        tags(&store).await.is_empty(),
        "the table the account name mentions is intact"
    );
    // A retry here reads the record with a prepared statement (the key was
    // claimed here); on another instance it fails the opening's absence check
    // and reads the record back in the simple-query protocol's text format.
    // The same answer both ways.
    let schema = schema_of(store.pool()).await;
    let other = another_instance(&url, schema).await;
    for instance in [&*store, &other] {
        match instance.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() {
            TxClaim::Other(ClaimOutcome::Replay(replayed)) => assert_eq!(replayed, response),
            _ => panic!("the retry replays"),
        }
    }
}

/// A first request's record does not exist until its commit, and its token is
/// drawn then: the holder gets the provisional token, the record a real one
/// above every token drawn before. A claim with a different token cannot
/// complete it. The connection that answered a retry from the opening's failed
/// check goes back to the pool outside any transaction.
#[tokio::test]
async fn a_first_requests_record_and_token_are_written_at_commit() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let before = scope("a", "token-before");
    let TxClaim::Claimed { tx, lease } = store.claim_in_tx(&claim_req(&before, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    assert_eq!(lease.token, PROVISIONAL_TOKEN);
    store
        .complete_in_tx(tx, &before, lease.token, &response(201, "one"))
        .await
        .unwrap();
    let first = store.get(&before).await.unwrap().expect("stored").fencing_token;

    let s = scope("a", "token-at-commit");
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    insert_tag(&mut *tx, "kept").await;
    let schema = schema_of(&mut *tx).await;
    let other = another_instance(&url, schema).await;
    assert!(
        other.get(&s).await.unwrap().is_none(),
        "nothing written before the commit"
    );
    let err = store
        .complete_in_tx(tx, &s, FencingToken(lease.token.0 + 1), &response(201, "two"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Fenced), "{err:?}");
    assert!(
        tags(&store).await.is_empty(),
        "the refused completion committed nothing"
    );

    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("the key is still free")
    };
    insert_tag(&mut *tx, "kept").await;
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "two"))
        .await
        .unwrap();
    let rec = store.get(&s).await.unwrap().expect("stored");
    assert!(
        rec.fencing_token > first,
        "{:?} after {first:?}",
        rec.fencing_token
    );
    assert_eq!(tags(&store).await, ["kept"]);

    // A retry on an instance that has not claimed the key: the opening's check
    // fails, the record is read in the round trip that rolls it back, and
    // that instance's only connection is clean.
    let schema = schema_of(store.pool()).await;
    let fresh = one_connection_instance(&url, schema).await;
    assert!(matches!(
        fresh.claim_in_tx(&claim_req(&s, "{}")).await.unwrap(),
        TxClaim::Other(ClaimOutcome::Replay(_))
    ));
    // The only connection, reused: autocommitted, seen from elsewhere.
    insert_tag(fresh.pool(), "after").await;
    let seen: Vec<String> = sqlx::query_scalar("SELECT tag FROM biz ORDER BY tag")
        .fetch_all(other.pool())
        .await
        .unwrap();
    assert_eq!(seen, ["after", "kept"]);
}

/// A single-step claim of an absent key writes nothing until it completes;
/// a lease-mode claim of the same key (which takes no advisory lock) that
/// commits in between wins: the completion reports a conflict and the
/// handler's write does not commit.
#[tokio::test]
async fn a_completion_that_finds_the_key_taken_commits_nothing() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let s = scope("a", "fused-taken");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    insert_tag(&mut *tx, "lost").await;
    let schema = schema_of(&mut *tx).await;
    let other = another_instance(&url, schema).await;
    let idemkit_core::ClaimOutcome::Claimed(held) = other.claim(&req).await.unwrap() else {
        panic!("the lease-mode claim sees the key absent")
    };
    let err = store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict), "{err:?}");
    assert!(tags(&store).await.is_empty(), "nothing committed");
    let rec = store.get(&s).await.unwrap().expect("the lease-mode record");
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.fencing_token, held.token);
}

/// A completion of a moved record (here a lease-mode record taken over) that
/// changes no row (the handler deleted it) aborts before the `COMMIT`: the
/// business write does not commit.
#[tokio::test]
async fn a_completion_that_changes_no_row_commits_nothing() {
    let Some((_, store)) = one_connection_store().await else {
        return;
    };
    let s = scope("a", "fused-miss");
    let mut req = claim_req(&s, "{}");
    req.lease = std::time::Duration::from_millis(1);
    let idemkit_core::ClaimOutcome::Claimed(_) = store.claim(&req).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("an expired lease is taken over")
    };
    insert_tag(&mut *tx, "lost").await;
    sqlx::query("DELETE FROM idemkit_keys WHERE account = 'a' AND idem_key = 'fused-miss'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Fenced), "{err:?}");
    assert!(tags(&store).await.is_empty(), "nothing committed");
    assert_eq!(
        store.get(&s).await.unwrap().expect("kept").state,
        RecordState::InFlight
    );
}

/// A claim cancelled while its opening round trip waits for the key's lock
/// (the caller's deadline, a client gone) must not leave its connection in the
/// pool inside a transaction: once the holder commits, the server grants the
/// lock to that transaction, which nobody would ever end. The connection is
/// closed instead; the next query on the pool runs in a transaction of its own.
#[tokio::test]
async fn a_claim_cancelled_while_waiting_for_the_lock_leaves_no_transaction_behind() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let schema = schema_of(store.pool()).await;
    let holder = another_instance(&url, schema).await;
    let s = scope("a", "cancelled-wait");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { tx, lease } = holder.claim_in_tx(&req).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    let mut waiting = req.clone();
    waiting.lock_wait = std::time::Duration::from_secs(10);
    let cancelled =
        tokio::time::timeout(std::time::Duration::from_millis(300), store.claim_in_tx(&waiting)).await;
    assert!(cancelled.is_err(), "the claim was still waiting for the lock");
    holder
        .complete_in_tx(tx, &s, lease.token, &response(201, "held"))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let own_transaction: bool =
        sqlx::query_scalar("SELECT clock_timestamp() - transaction_timestamp() < interval '100 ms'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert!(
        own_transaction,
        "the pool's connection was inside a leftover transaction"
    );
    match store.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(idemkit_core::ClaimOutcome::Replay(r)) => {
            assert_eq!(r, response(201, "held"))
        }
        TxClaim::Other(o) => panic!("expected the replay, got {o:?}"),
        TxClaim::Claimed { .. } => panic!("the key was claimed again"),
    }
}

/// On a pool with one connection for queries: a handler's nested transaction is a savepoint
/// (sqlx still counts the claim's transaction), and after the fused commit the
/// connection is back outside any transaction: its next autocommitted write is
/// visible at once to another connection.
#[tokio::test]
async fn the_connection_leaves_the_fused_commit_clean() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let s = scope("a", "fused-clean");
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    insert_tag(&mut *tx, "kept").await;
    {
        let mut nested = Connection::begin(&mut *tx).await.unwrap();
        insert_tag(&mut *nested, "undone").await;
        nested.rollback().await.unwrap();
    }
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap();
    assert_eq!(tags(&store).await, ["kept"]);

    // The only connection, reused: autocommitted, seen from elsewhere.
    insert_tag(store.pool(), "after").await;
    let schema = schema_of(store.pool()).await;
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    let seen: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT tag FROM {schema}.biz ORDER BY tag"
    )))
    .fetch_all(&mut other)
    .await
    .unwrap();
    assert_eq!(seen, ["after", "kept"]);

    // And the next single-step claim on it begins a real transaction again.
    let s2 = scope("a", "fused-clean-2");
    let TxClaim::Claimed { tx, .. } = store.claim_in_tx(&claim_req(&s2, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    drop(tx);
    assert!(
        store.get(&s2).await.unwrap().is_none(),
        "dropped claim rolled back"
    );
}

/// The pool skips the ping for connections in steady use, but one that sat
/// idle past `PgConfig::ping_if_idle_for` is checked before use: after the
/// server drops it (here terminated from another session), the next operation
/// gets a fresh connection instead of failing.
#[tokio::test]
async fn a_connection_dropped_while_idle_is_replaced_before_use() {
    use std::time::Duration;

    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let s = scope("a", "idle-dropped");
    assert!(store.get(&s).await.unwrap().is_none());
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert!(terminated);
    tokio::time::sleep(store.config().ping_if_idle_for() + Duration::from_millis(200)).await;
    let idemkit_core::ClaimOutcome::Claimed(_) = store
        .claim(&claim_req(&s, "{}"))
        .await
        .expect("a fresh connection")
    else {
        panic!("a fresh key is claimed")
    };
    let now: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_ne!(now, pid, "the dropped connection was replaced");
}

/// Four instances (four pools, four empty recent-key hints) race one key with
/// eight tasks each: each instance's first claims take the opening's try-lock
/// and absence check; those that find the lock held answer in progress, and
/// those that get it after the winner's commit fail the check and answer from
/// the record. The business row is written once; every other answer is the
/// stored response, in progress, or a conflict at commit whose write was
/// rolled back. A retry then replays on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_racing_one_key_write_once() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let schema = schema_of(store.pool()).await;
    let mut instances = Vec::new();
    for _ in 0..4 {
        let config = PgConfig::default()
            .with_schema(schema.clone())
            .with_max_connections(4);
        instances.push(Arc::new(
            PgStore::connect_with(&url, config).await.expect("connect"),
        ));
    }
    let s = scope("a", "instances-race");
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (store, barrier, s) = (instances[i % 4].clone(), barrier.clone(), s.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                match store.claim_in_tx(&claim_req(&s, "{}")).await.expect("claim") {
                    TxClaim::Claimed { mut tx, lease } => {
                        insert_tag(&mut *tx, "raced").await;
                        match store
                            .complete_in_tx(tx, &s, lease.token, &response(201, "won"))
                            .await
                        {
                            Ok(()) => "executed",
                            Err(StoreError::Conflict) => "conflict",
                            Err(e) => panic!("complete: {e}"),
                        }
                    }
                    TxClaim::Other(ClaimOutcome::Replay(r)) => {
                        assert_eq!(r, response(201, "won"));
                        "replayed"
                    }
                    TxClaim::Other(ClaimOutcome::InProgress { .. }) => "in progress",
                    TxClaim::Other(other) => panic!("unexpected {other:?}"),
                }
            })
        })
        .collect();
    let mut answers = std::collections::BTreeMap::<&str, usize>::new();
    for t in tasks {
        *answers.entry(t.await.unwrap()).or_default() += 1;
    }
    assert_eq!(answers.get("executed"), Some(&1), "{answers:?}");
    assert_eq!(tags(&store).await, ["raced"], "{answers:?}");
    // Every instance now answers the retry from the record, whichever way it opens.
    for instance in &instances {
        assert!(matches!(
            instance.claim_in_tx(&claim_req(&s, "{}")).await.unwrap(),
            TxClaim::Other(ClaimOutcome::Replay(_))
        ));
    }
}

/// A claim whose transaction was dropped (a handler that failed, a caller that
/// hung up) leaves the key free, and a retry that follows at once is claimed:
/// the dropped transaction's `ROLLBACK` rides on its connection's release, so
/// its lock can outlive the answer by a moment, which the opening's one more
/// try after a short grace covers. A live holder still answers in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_right_after_a_dropped_claim_is_claimed() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let other = another_instance(&url, schema_of(store.pool()).await).await;
    for round in 0..20 {
        let s = scope("a", &format!("dropped-{round}"));
        let req = claim_req(&s, "{}");
        let TxClaim::Claimed { mut tx, .. } = store.claim_in_tx(&req).await.unwrap() else {
            panic!("first claim")
        };
        insert_tag(&mut *tx, "rolled back").await;
        drop(tx);
        // Another instance, then this one, at once.
        let instance = if round % 2 == 0 { &other } else { &*store };
        match instance.claim_in_tx(&req).await.unwrap() {
            TxClaim::Claimed { tx, lease } => {
                instance
                    .complete_in_tx(tx, &s, lease.token, &response(201, "second"))
                    .await
                    .unwrap();
            }
            TxClaim::Other(o) => panic!("round {round}: the key is free, got {o:?}"),
        }
    }
    assert!(tags(&store).await.is_empty(), "dropped writes rolled back");
    // The control: a live holder answers in progress.
    let s = scope("a", "live");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { tx: _held, .. } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("holder")
    };
    assert!(matches!(
        other.claim_in_tx(&req).await.unwrap(),
        TxClaim::Other(ClaimOutcome::InProgress { .. })
    ));
}

/// The single-step transaction is READ COMMITTED whatever the database's
/// default: under REPEATABLE READ the check after the lock could miss what
/// the lock's previous holder committed.
#[tokio::test]
async fn single_step_transactions_are_read_committed_whatever_the_default() {
    let Some((url, store)) = one_connection_store().await else {
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let rr = format!("{url}{sep}options=-c%20default_transaction_isolation%3Drepeatable%5C%20read");
    let instance = another_instance(&rr, schema_of(store.pool()).await).await;
    let default: String = sqlx::query_scalar("SHOW default_transaction_isolation")
        .fetch_one(instance.pool())
        .await
        .unwrap();
    assert_eq!(default, "repeatable read", "the control: the session default");
    for (i, seen) in [false, true].into_iter().enumerate() {
        // A first claim opens with the absence check; a key claimed here
        // before (`seen`) is read first and opened with it too.
        let s = scope("a", &format!("isolation-{i}"));
        if seen {
            let TxClaim::Claimed { tx, .. } = instance.claim_in_tx(&claim_req(&s, "{}")).await.unwrap()
            else {
                panic!("claim")
            };
            drop(tx);
        }
        let TxClaim::Claimed { mut tx, .. } = instance.claim_in_tx(&claim_req(&s, "{}")).await.unwrap()
        else {
            panic!("claim")
        };
        let level: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(level, "read committed", "seen: {seen}");
    }
}

/// Advisory locks held by the backend `pid`, counted by `observer`.
async fn advisory_locks(observer: &mut sqlx::PgConnection, pid: i32) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1")
        .bind(pid)
        .fetch_one(observer)
        .await
        .unwrap()
}

/// `rollback_tx` frees the key's advisory lock before it returns, savepoints a
/// handler left open included: a retry sent on the answer that follows finds
/// the key free. On a pool that delays its release check (where a dropped
/// transaction's `ROLLBACK` rides), this fails when `rollback_tx` merely drops.
#[tokio::test]
async fn rollback_tx_frees_the_keys_lock_before_returning() {
    let Some((url, store)) = slow_release_store().await else {
        return;
    };
    let mut observer = sqlx::PgConnection::connect(&url).await.unwrap();
    for round in 0..3 {
        let s = scope("a", &format!("rollback-{round}"));
        let TxClaim::Claimed { mut tx, .. } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
            panic!("a fresh key is claimed");
        };
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(
            advisory_locks(&mut observer, pid).await,
            1,
            "the control: the open transaction holds the key's lock"
        );
        if round == 1 {
            // A handler's nested transaction, leaked open: a savepoint
            // rolled back alone would leave the transaction and its lock.
            std::mem::forget(sqlx::Connection::begin(&mut *tx).await.unwrap());
        }
        store.rollback_tx(tx).await;
        assert_eq!(
            advisory_locks(&mut observer, pid).await,
            0,
            "round {round}: the lock is free when rollback_tx returns"
        );
    }
}

/// A completion refused before it sends anything (a stale token) rolls its
/// transaction back before it returns: no statement failed, so without the
/// rollback the transaction, and the key's lock, would stay open until the
/// pool's release check. (A completion whose statement fails needs no such
/// care for the lock: PostgreSQL aborts the transaction, releasing its locks,
/// at the error.)
#[tokio::test]
async fn a_completion_refused_before_sending_frees_the_keys_lock() {
    let Some((url, store)) = slow_release_store().await else {
        return;
    };
    let mut observer = sqlx::PgConnection::connect(&url).await.unwrap();
    let s = scope("a", "refused-completion");
    let TxClaim::Claimed { mut tx, .. } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    insert_tag(&mut *tx, "refused").await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(advisory_locks(&mut observer, pid).await, 1, "the control");
    let err = store
        .complete_in_tx(tx, &s, FencingToken(7), &response(201, "ok"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Fenced), "{err:?}");
    assert_eq!(
        advisory_locks(&mut observer, pid).await,
        0,
        "the key's lock is free when the refusal is reported"
    );
    assert!(tags(&store).await.is_empty(), "nothing committed");
}

/// `PgTx::rollback` answers like `SqliteTx::rollback` (`Result<(), sqlx::Error>`,
/// with the sqlx this crate re-exports): a confirmed rollback is `Ok`, and the
/// key is free again at once (its lock released before the call returned).
#[tokio::test]
async fn an_explicit_rollback_is_confirmed_and_frees_the_key() {
    let Some((_url, store)) = one_connection_store().await else {
        return;
    };
    let s = scope("acct-rollback", "explicit-rollback");
    let TxClaim::Claimed { tx, .. } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    let rolled_back: Result<(), idemkit_postgres::sqlx::Error> = tx.rollback().await;
    rolled_back.expect("the database confirmed the rollback");
    assert!(
        matches!(
            store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap(),
            TxClaim::Claimed { .. }
        ),
        "the rolled-back claim left the key held"
    );
}
