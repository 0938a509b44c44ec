//! SQLite runs the store conformance suite, each test on a fresh database file.

use std::sync::Arc;

use async_trait::async_trait;
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_testkit::ManualClock;
use idemkit_testkit::tx_suite::BusinessProbe;

/// A fresh database in its own temporary directory (kept alive for the test).
async fn fresh(clock: Arc<ManualClock>) -> Arc<SqliteStore> {
    let dir = test_dir("test");
    let store = SqliteStore::connect(dir.join("keys.db"))
        .await
        .expect("open sqlite");
    Arc::new(store.with_clock(clock))
}

/// A new, empty directory of its own for one test (`tag` names the test).
fn test_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idemkit-sqlite-{tag}-{}", uuid_like()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

struct Orders(Arc<SqliteStore>);

async fn probe(store: Arc<SqliteStore>) -> Orders {
    sqlx::query("CREATE TABLE IF NOT EXISTS biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    Orders(store)
}

#[async_trait]
impl BusinessProbe<SqliteStore> for Orders {
    async fn insert(&self, tx: &mut SqliteTx, tag: &str) {
        sqlx::query("INSERT INTO biz (tag) VALUES (?1)")
            .bind(tag.to_owned())
            .execute(&mut **tx)
            .await
            .unwrap();
    }
    async fn count(&self, tag: &str) -> usize {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM biz WHERE tag = ?1")
            .bind(tag.to_owned())
            .fetch_one(self.0.pool())
            .await
            .unwrap();
        n as usize
    }
}

#[cfg(feature = "failpoints")]
mod claim_reply;
mod reap;
mod takeover;

mod conformance {
    use super::*;
    idemkit_testkit::store_conformance_tests!(fresh);
}

mod transactional {
    use super::*;
    idemkit_testkit::transactional_conformance_tests!(fresh, probe);
}

mod lifecycle {
    use super::*;
    idemkit_testkit::lifecycle_conformance_tests!(fresh);
}

mod transactional_lifecycle {
    use super::*;
    idemkit_testkit::transactional_lifecycle_tests!(fresh, probe);
}

/// Phases are for lease-mode holders: a transaction carrying a pending
/// single-step claim (written, completed, at commit) has no record to advance.
#[tokio::test]
async fn advance_in_a_single_step_claim_is_unsupported() {
    use idemkit_core::{PhaseUpdate, StoreError, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, response, scope};
    let store = fresh(Arc::new(ManualClock::new())).await;
    let s = scope("a", "single-step-phase");
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("claims")
    };
    let update = PhaseUpdate {
        recovery_point: "p".into(),
        step: None,
    };
    let err = store.advance_in_tx(&mut tx, &s, lease.token, &update).await;
    assert!(
        matches!(
            err,
            Err(StoreError::Unsupported("phases inside a single-step claim"))
        ),
        "{err:?}"
    );
    // The claim itself is unharmed.
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap();
}

/// A single-step completion whose insert fails for any reason but another
/// process's row (here the database refuses writes) is that failure, not a
/// `Conflict`: a conflict tells the engine to read the other row and answer
/// from it, which would hide a database that cannot write.
#[tokio::test]
async fn a_completion_that_cannot_write_is_not_a_conflict() {
    use idemkit_core::{StoreError, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, response, scope};
    let store = fresh(Arc::new(ManualClock::new())).await;
    let s = scope("a", "read-only-at-commit");
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("claims")
    };
    sqlx::query("PRAGMA query_only = ON")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .expect_err("a read-only database cannot take the record");
    assert!(!matches!(err, StoreError::Conflict), "{err:?}");
}

/// A database created before the lifecycle migration keeps its records and
/// gains the `parked` state and the review table.
#[tokio::test]
async fn lifecycle_migration_keeps_existing_records() {
    use idemkit_core::{Clock, KeyStore, RecordState};
    use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
    use sqlx::migrate::Migrator;
    let dir = test_dir("migrate");
    let url = format!("sqlite://{}?mode=rwc", dir.join("old.db").display());
    let clock = Arc::new(ManualClock::new());
    let s = scope("a", "before-upgrade");
    {
        // The schema as the first release shipped it, with one record in it.
        let first = dir.join("first-migration");
        std::fs::create_dir_all(&first).unwrap();
        let name = "20261130000001_idemkit_keys.sql";
        std::fs::copy(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations")
                .join(name),
            first.join(name),
        )
        .unwrap();
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        Migrator::new(first).await.unwrap().run(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, lease_expires_at, \
             fencing_token, req_method, req_path, req_headers, req_body, recovery_point, step_outputs) \
             VALUES ('a', 'before-upgrade', ?1, 'in_flight', ?2, ?3, 3, 'POST', '/orders', '[]', x'', 'rp', \
             '{\"s\":1}')",
        )
        .bind(&claim_req(&s, "{}").fingerprint.as_bytes()[..])
        .bind(clock.now().0 - 60_000)
        .bind(clock.now().0 - 30_000)
        .execute(&pool)
        .await
        .unwrap();
        pool.close().await;
    }
    let store = SqliteStore::connect(&url).await.unwrap().with_clock(clock);
    let rec = store.get(&s).await.unwrap().expect("kept");
    assert_eq!(rec.fencing_token.0, 3);
    assert_eq!(rec.step_outputs["s"], 1);
    assert_eq!(rec.recovery_point.as_deref(), Some("rp"));
    let lease = must_claim(&store, &claim_req(&s, "{}")).await;
    assert_eq!(lease.resumed_from.as_deref(), Some("rp"));
    store.park(&s, lease.token, "parked after upgrade").await.unwrap();
    assert_eq!(store.get(&s).await.unwrap().unwrap().state, RecordState::Parked);
    let other = scope("a", "after-upgrade");
    let l = must_claim(&store, &claim_req(&other, "{}")).await;
    store
        .complete(&other, l.token, &response(201, "x"))
        .await
        .unwrap();
}

#[tokio::test]
async fn opens_sqlite_urls_and_reopens_existing_files() {
    let dir = test_dir("url");
    let path = dir.join("u.db");
    let url = format!("sqlite://{}", path.display());
    let a = SqliteStore::connect(&url).await.expect("url form");
    drop(a);
    // Migrations are idempotent on reopen.
    let b = SqliteStore::connect(&path).await.expect("path form");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(b.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
}

/// A file a newer release migrated further (a version this build does not
/// know) still opens and serves: migrations are additive, so going back to an
/// older binary keeps working. The control: sqlx's default migrator, strict
/// about unknown versions, refuses the same file.
#[tokio::test]
async fn a_file_migrated_by_a_newer_release_still_opens() {
    use idemkit_core::{ClaimOutcome, KeyStore};
    use idemkit_testkit::suite::{claim_req, scope};
    let path = test_dir("newer").join("n.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (99991231000001, 'from a newer release', TRUE, X'00', 0)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let mut strict = sqlx::migrate!("./migrations");
    // Without its lock: a run that fails leaves the lock taken (per database,
    // so every other test's store would wait on it).
    strict.set_locking(false);
    assert!(
        matches!(
            strict.run(store.pool()).await,
            Err(sqlx::migrate::MigrateError::VersionMissing(99991231000001))
        ),
        "the control: a strict migrator refuses the unknown version"
    );
    drop(store);
    let store = SqliteStore::connect(&path)
        .await
        .expect("a newer release's migration does not stop this one");
    let s = scope("a", "after-newer");
    assert!(matches!(
        store.claim(&claim_req(&s, "{}")).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
}

/// A duplicate arriving while a single-step claim of the same process is
/// pending answers "in progress" at once; it does not queue for the write lock.
#[tokio::test]
async fn in_process_duplicate_of_a_pending_single_step_claim_is_in_progress() {
    use idemkit_core::{ClaimOutcome, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, response, scope};
    let store = fresh(Arc::new(ManualClock::new())).await;
    let s = scope("a", "pending");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { tx, lease } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("first claims")
    };
    match store.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::InProgress { .. }) => {}
        other => panic!("expected in progress, got {other:?}"),
    }
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "one"))
        .await
        .unwrap();
    match store.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "one")),
        other => panic!("expected replay, got {other:?}"),
    }
}

/// Two stores on one file stand for two processes: each passes its own
/// in-process checks, and the primary key decides at commit. The loser's
/// business write rolls back with its claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_racing_one_key_commit_once() {
    use idemkit_core::{StoreError, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, response, scope};
    let dir = test_dir("two");
    let path = dir.join("shared.db");
    let a = Arc::new(SqliteStore::connect(&path).await.unwrap());
    let b = Arc::new(SqliteStore::connect(&path).await.unwrap());
    let orders = probe(a.clone()).await;
    let s = scope("acct", "race");
    let req = claim_req(&s, "{}");
    // Both read "absent" before either writes.
    let TxClaim::Claimed {
        tx: mut tx_a,
        lease: la,
    } = a.claim_in_tx(&req).await.unwrap()
    else {
        panic!()
    };
    let b_task = tokio::spawn({
        let (b, req, s) = (b.clone(), req.clone(), s.clone());
        async move {
            // Blocks on SQLite's write lock until A commits.
            let TxClaim::Claimed { mut tx, lease } = b.claim_in_tx(&req).await.unwrap() else {
                return None;
            };
            sqlx::query("INSERT INTO biz (tag) VALUES ('race')")
                .execute(&mut *tx)
                .await
                .unwrap();
            Some(b.complete_in_tx(tx, &s, lease.token, &response(201, "B")).await)
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    orders.insert(&mut tx_a, "race").await;
    a.complete_in_tx(tx_a, &s, la.token, &response(201, "A"))
        .await
        .unwrap();
    match b_task.await.unwrap() {
        Some(Err(StoreError::Conflict)) => {}
        other => panic!("B must lose at commit, got {other:?}"),
    }
    assert_eq!(orders.count("race").await, 1, "B's business write rolled back");
}

/// A second store on the file (another process) opened before a key was
/// written does not know the key: its single-step claim skips the read, runs
/// the handler, and loses at commit on the primary key, its business write
/// rolled back. It then knows the key: the retry replays without running the
/// handler.
#[tokio::test]
async fn a_key_unknown_to_this_process_is_arbitrated_by_the_primary_key() {
    use idemkit_core::{ClaimOutcome, KeyStore, StoreError, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
    let dir = test_dir("unknown");
    let path = dir.join("shared.db");
    let a = Arc::new(SqliteStore::connect(&path).await.unwrap());
    let b = Arc::new(SqliteStore::connect(&path).await.unwrap());
    assert!(a.keys_loaded().await && b.keys_loaded().await);
    let orders = probe(a.clone()).await;
    let s = scope("acct", "written-by-a");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { mut tx, lease } = a.claim_in_tx(&req).await.unwrap() else {
        panic!("A claims")
    };
    orders.insert(&mut tx, "unknown").await;
    a.complete_in_tx(tx, &s, lease.token, &response(201, "A"))
        .await
        .unwrap();

    let TxClaim::Claimed { mut tx, lease } = b.claim_in_tx(&req).await.unwrap() else {
        panic!("B has not seen the key: it claims without reading")
    };
    orders.insert(&mut tx, "unknown").await;
    match b.complete_in_tx(tx, &s, lease.token, &response(201, "B")).await {
        Err(StoreError::Conflict) => {}
        other => panic!("B must lose at commit, got {other:?}"),
    }
    assert_eq!(orders.count("unknown").await, 1, "B's business write rolled back");
    match b.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "A")),
        other => panic!("B's retry must replay A's answer, got {other:?}"),
    }

    // Lease mode: an unknown key's insert finds the row and the claim decides on it.
    let s2 = scope("acct", "held-by-a");
    let req2 = claim_req(&s2, "{}");
    let held = must_claim(a.as_ref(), &req2).await;
    match b.claim(&req2).await.unwrap() {
        ClaimOutcome::InProgress { .. } => {}
        other => panic!("A holds the key, got {other:?}"),
    }
    a.complete(&s2, held.token, &response(201, "A2")).await.unwrap();
    match b.claim(&req2).await.unwrap() {
        ClaimOutcome::Replay(r) => assert_eq!(r, response(201, "A2")),
        other => panic!("expected A's replay, got {other:?}"),
    }
}

/// A store opened on a file that has keys knows them: a retry of one reads it
/// and replays, and its handler never runs.
#[tokio::test]
async fn a_store_opened_on_existing_keys_reads_them_before_claiming() {
    use idemkit_core::{ClaimOutcome, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, response, scope};
    let dir = test_dir("reopen");
    let path = dir.join("keys.db");
    let s = scope("acct", "before-restart");
    let req = claim_req(&s, "{}");
    {
        let first = SqliteStore::connect(&path).await.unwrap();
        let TxClaim::Claimed { tx, lease } = first.claim_in_tx(&req).await.unwrap() else {
            panic!("claims")
        };
        first
            .complete_in_tx(tx, &s, lease.token, &response(201, "before"))
            .await
            .unwrap();
        first.pool().close().await;
    }
    let restarted = SqliteStore::connect(&path).await.unwrap();
    // Before the table is loaded every key is read first; after, this one is known.
    match restarted.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "before")),
        other => panic!("expected a replay without a claim, got {other:?}"),
    }
    assert!(restarted.keys_loaded().await);
    match restarted.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "before")),
        other => panic!("expected a replay without a claim, got {other:?}"),
    }
}
/// The negative control of the transactional suites: with fencing gone from
/// every lease-holder write (inside transactions too), some case fails.
mod negative_control {
    use std::time::Duration;

    use idemkit_testkit::mutants::{UnfencedProbe, UnfencedTx};
    use idemkit_testkit::{TxCase, lifecycle, tx_suite};

    use super::*;

    async fn failing_cases(mutant: bool) -> Vec<&'static str> {
        type Mutant = UnfencedTx<SqliteStore>;
        let cases: Vec<(&str, TxCase<Mutant, UnfencedProbe<Orders>>)> = tx_suite::cases()
            .into_iter()
            .chain(lifecycle::tx_cases())
            .collect();
        let mut failed = Vec::new();
        for (name, case) in cases {
            let clock = Arc::new(ManualClock::new());
            let inner = fresh(clock.clone()).await;
            let probe = UnfencedProbe(probe(inner.clone()).await);
            let store = Arc::new(UnfencedTx::new(inner));
            let run = if mutant {
                tokio::spawn(tokio::time::timeout(
                    Duration::from_secs(60),
                    case(store, probe, clock),
                ))
            } else {
                // The same harness on the real store: no failure is the harness's.
                let real: Vec<(&str, TxCase<SqliteStore, Orders>)> = tx_suite::cases()
                    .into_iter()
                    .chain(lifecycle::tx_cases())
                    .collect();
                let (_, case) = real.into_iter().find(|(n, _)| *n == name).unwrap();
                let inner = store.inner().clone();
                tokio::spawn(tokio::time::timeout(
                    Duration::from_secs(60),
                    case(inner, probe.0, clock),
                ))
            };
            match run.await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("{name} hung"),
                Err(e) if e.is_panic() => failed.push(name),
                Err(e) => panic!("{name}: {e}"),
            }
        }
        failed
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_transactional_suites_catch_unfenced_writes() {
        assert_eq!(failing_cases(false).await, Vec::<&str>::new(), "the real store");
        let failed = failing_cases(true).await;
        eprintln!("unfenced writes caught by {failed:?}");
        for case in [
            "fenced_completion_rolls_back_business_writes",
            "stale_token_cannot_open_a_transaction",
            "stale_token_cannot_advance_in_a_tx",
        ] {
            assert!(
                failed.contains(&case),
                "{case} missed unfenced writes: {failed:?}"
            );
        }
    }
}

/// `SqliteTx` runs SQLite's own transaction. A caller that gives up while it
/// is being opened, used or committed (a client that hung up, a deadline) must
/// never leave the pool's connection inside a transaction: on a pool of one
/// connection, after hundreds of cancellations at every point, an autocommitted
/// write is at once visible to another connection and a new transaction opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_transactions_never_leave_the_connection_in_one() {
    use std::time::Duration;

    use idemkit_sqlite::SqliteConfig;
    use sqlx::Connection;

    let dir = test_dir("cancel");
    let path = dir.join("keys.db");
    let config = SqliteConfig::default()
        .with_max_connections(1)
        .with_busy_timeout(Duration::from_secs(2));
    let store = SqliteStore::connect_with(&path, config).await.unwrap();
    sqlx::query("CREATE TABLE biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    for i in 0..300u64 {
        let work = async {
            let mut tx = store.begin().await.unwrap();
            sqlx::query("INSERT INTO biz (tag) VALUES ('cancelled?')")
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        };
        // Cancelled after a varying number of polls (0 to 4 yields' worth of progress).
        let _ = tokio::time::timeout(Duration::from_micros(i % 60), work).await;
    }
    // Let the rollbacks of the cancelled ones run.
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("INSERT INTO biz (tag) VALUES ('after')")
        .execute(store.pool())
        .await
        .unwrap();
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM biz WHERE tag = 'after'")
        .fetch_one(&mut other)
        .await
        .unwrap();
    assert_eq!(
        after, 1,
        "the autocommitted write is visible: the connection was not inside a transaction"
    );
    let tx = store.begin().await.expect("a new transaction opens");
    let rolled_back: Result<(), idemkit_sqlite::sqlx::Error> = tx.rollback().await;
    rolled_back.unwrap();
}

/// The write-ahead log reaches the database file through the background
/// checkpoints, not through the commits: with the task on, the file grows
/// while no commit crossed SQLite's own threshold; with it off, the same
/// writes stay in the log (the control).
#[tokio::test]
async fn the_log_is_checkpointed_in_the_background() {
    use std::time::Duration;

    use idemkit_sqlite::SqliteConfig;

    async fn file_len_after_writes(tag: &str, checkpoint_interval: Duration) -> (u64, u64) {
        let path = test_dir(tag).join("keys.db");
        let config = SqliteConfig::default().with_checkpoint_interval(checkpoint_interval);
        let store = SqliteStore::connect_with(&path, config).await.unwrap();
        // Whatever opening wrote, checkpointed: the file's size before the writes.
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(store.pool())
            .await
            .unwrap();
        sqlx::query("CREATE TABLE biz (tag TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(store.pool())
            .await
            .unwrap();
        let before = std::fs::metadata(&path).unwrap().len();
        // ~200 small commits: a few hundred log pages, under SQLite's own
        // threshold of 1 000, with a row the file's pages must grow to hold.
        for i in 0..200 {
            sqlx::query("INSERT INTO biz (tag) VALUES (?1)")
                .bind(format!("{i:0>200}"))
                .execute(store.pool())
                .await
                .unwrap();
        }
        let mut after = std::fs::metadata(&path).unwrap().len();
        for _ in 0..100 {
            if after > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            after = std::fs::metadata(&path).unwrap().len();
        }
        (before, after)
    }

    let (before, after) = file_len_after_writes("checkpoint-on", Duration::from_millis(20)).await;
    assert!(
        after > before,
        "the background checkpoint wrote the rows into the file: {before} -> {after}"
    );
    let (before, after) = file_len_after_writes("checkpoint-off", Duration::ZERO).await;
    assert_eq!(
        after, before,
        "no checkpoint ran: the rows are still only in the log"
    );
}

/// Under `Durability::Claims`, every lease-mode claim (an absent key's insert,
/// and a released key claimed again, which moves its record) commits on the
/// connection that syncs (`synchronous = FULL`), and nothing else does: a
/// completion or a release commits on the pool, which does not wait.
#[tokio::test]
async fn claims_commit_on_the_syncing_connection_and_nothing_else_does() {
    use idemkit_core::{ClaimOutcome, KeyStore};
    use idemkit_sqlite::{Durability, SqliteConfig};
    use idemkit_testkit::suite::{claim_req, scope};

    async fn pragma(pool: &sqlx::SqlitePool) -> (i64, i64) {
        let mut conn = pool.acquire().await.unwrap();
        let sync = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let changes = sqlx::query_scalar("SELECT total_changes()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        (sync, changes)
    }
    let dir = test_dir("durable-claims");
    let config = SqliteConfig::default().with_durability(Durability::Claims);
    let store = SqliteStore::connect_with(dir.join("keys.db"), config)
        .await
        .unwrap();
    let claims = store.claims_pool().expect("a syncing connection").clone();
    let s = scope("a", "k");
    let ClaimOutcome::Claimed(lease) = store.claim(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("claimed")
    };
    assert_eq!(pragma(&claims).await, (2, 1), "the insert");
    store.release(&s, lease.token).await.unwrap();
    assert_eq!(pragma(&claims).await, (2, 1), "the release is not a claim");
    let ClaimOutcome::Claimed(_) = store.claim(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("claimed again")
    };
    assert_eq!(pragma(&claims).await, (2, 2), "the move of the released record");
    assert_eq!(pragma(store.pool()).await.0, 1, "the pool does not wait");
    // The control: the default has no syncing connection.
    let plain = SqliteStore::connect(dir.join("plain.db")).await.unwrap();
    assert!(plain.claims_pool().is_none());
}

/// The error chain as anyhow's `{:#}` prints it, and how often the
/// outermost source's own text appears in it (once: the kind does not repeat it).
fn chain_and_source_count(e: idemkit_core::StoreError) -> (String, usize) {
    let source = std::error::Error::source(&e)
        .expect("a wrapped error")
        .to_string();
    let chain = format!("{:#}", anyhow::Error::new(e));
    let n = chain.matches(source.as_str()).count();
    (chain, n)
}

/// A location sqlx cannot parse and a pool of no connections are
/// configuration errors (not retryable), not database failures.
#[tokio::test]
async fn a_bad_location_or_setting_is_a_configuration_error() {
    use idemkit_core::StoreError;
    use idemkit_sqlite::{SqliteConfig, SqliteConfigError};
    let err = SqliteStore::connect("sqlite://keys.db?mode=bogus")
        .await
        .unwrap_err();
    assert!(!err.is_retryable(), "{err:?}");
    match &err {
        StoreError::Config(e) => assert!(
            matches!(
                e.downcast_ref::<SqliteConfigError>(),
                Some(SqliteConfigError::BadLocation { location, .. }) if location == "sqlite://keys.db?mode=bogus"
            ),
            "{e:?}"
        ),
        other => panic!("a malformed URL answered {other:?}"),
    }
    let dir = test_dir("config-error");
    let err = SqliteStore::connect_with(
        dir.join("keys.db"),
        SqliteConfig::default().with_max_connections(0),
    )
    .await
    .unwrap_err();
    match &err {
        StoreError::Config(e) => assert_eq!(
            e.downcast_ref::<SqliteConfigError>(),
            Some(&SqliteConfigError::NoConnections)
        ),
        other => panic!("zero connections answered {other:?}"),
    }
    assert!(!dir.join("keys.db").exists(), "refused before opening anything");
}

/// A database failure (a file in a directory that does not exist) is
/// `Backend`, and its cause appears once in the printed chain.
#[tokio::test]
async fn a_backend_error_prints_its_cause_once() {
    use idemkit_core::StoreError;
    let dir = test_dir("backend-chain");
    let err = SqliteStore::connect(dir.join("missing-dir").join("keys.db"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Backend(_)), "{err:?}");
    let (chain, n) = chain_and_source_count(err);
    assert!(chain.starts_with("key store failure: "), "{chain}");
    assert_eq!(n, 1, "the cause is printed {n} times: {chain}");
}
