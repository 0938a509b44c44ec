//! PostgreSQL runs the store conformance suite, each test in a fresh schema.
//!
//! Tests read `IDEMKIT_TEST_POSTGRES_URL`. Under `CI` a missing URL is a failure;
//! elsewhere the tests say so and return.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemkit_postgres::{PgConfig, PgStore, PgTx};
use idemkit_testkit::ManualClock;
use idemkit_testkit::tx_suite::BusinessProbe;

mod commits;
mod fencing;
mod hardening;
mod round3;
mod single_step;

/// The test database URL, or `None` (outside CI) when it is not configured.
pub(crate) fn database_url() -> Option<String> {
    match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => {
            panic!("IDEMKIT_TEST_POSTGRES_URL is not set; under CI a missing database is a failure")
        }
        _ => {
            eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: skipping PostgreSQL test");
            None
        }
    }
}

/// A schema name no other test uses.
pub(crate) fn fresh_schema() -> String {
    format!("t_{}", uuid::Uuid::new_v4().simple())
}

/// A fresh store in its own schema, or `None` when no database is configured.
pub(crate) async fn store_in_fresh_schema(clock: Option<Arc<ManualClock>>) -> Option<Arc<PgStore>> {
    let url = database_url()?;
    let config = PgConfig::default()
        .with_schema(fresh_schema())
        .with_max_connections(8);
    let mut store = PgStore::connect_with(&url, config)
        .await
        .expect("connect to PostgreSQL");
    if let Some(clock) = clock {
        store = store.with_test_clock(clock);
    }
    Some(Arc::new(store))
}

/// Conformance-suite factory: `None` outside CI when no database is configured.
async fn fresh(clock: Arc<ManualClock>) -> Option<Arc<PgStore>> {
    store_in_fresh_schema(Some(clock)).await
}

struct Orders(Arc<PgStore>);

async fn probe(store: Arc<PgStore>) -> Orders {
    sqlx::query("CREATE TABLE IF NOT EXISTS biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    Orders(store)
}

#[async_trait]
impl BusinessProbe<PgStore> for Orders {
    async fn insert(&self, tx: &mut PgTx, tag: &str) {
        sqlx::query("INSERT INTO biz (tag) VALUES ($1)")
            .bind(tag.to_owned())
            .execute(&mut **tx)
            .await
            .unwrap();
    }
    async fn count(&self, tag: &str) -> usize {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM biz WHERE tag = $1")
            .bind(tag.to_owned())
            .fetch_one(self.0.pool())
            .await
            .unwrap();
        n as usize
    }
}

mod conformance {
    use super::*;
    idemkit_testkit::store_conformance_tests!(optional fresh);
}

mod transactional {
    use super::*;
    idemkit_testkit::transactional_conformance_tests!(optional fresh, probe);
}

/// The single-step suites again with transactions at SERIALIZABLE (the
/// strictest level, whose openings take the key's lock first).
async fn fresh_serializable(clock: Arc<ManualClock>) -> Option<Arc<PgStore>> {
    let url = database_url()?;
    let config = PgConfig::default()
        .with_schema(fresh_schema())
        .with_max_connections(8)
        .with_single_step_isolation(idemkit_postgres::Isolation::Serializable);
    let store = PgStore::connect_with(&url, config)
        .await
        .expect("connect to PostgreSQL")
        .with_test_clock(clock);
    Some(Arc::new(store))
}

mod transactional_serializable {
    use super::*;
    idemkit_testkit::transactional_conformance_tests!(optional fresh_serializable, probe);
}

mod transactional_lifecycle_serializable {
    use super::*;
    idemkit_testkit::transactional_lifecycle_tests!(optional fresh_serializable, probe);
}

mod lifecycle {
    use super::*;
    idemkit_testkit::lifecycle_conformance_tests!(optional fresh);
}

mod transactional_lifecycle {
    use super::*;
    idemkit_testkit::transactional_lifecycle_tests!(optional fresh, probe);
}

/// A schema a newer release migrated further (a version this build does not
/// know) still opens and serves: an older instance restarting mid rolling
/// upgrade, or after a rollback, keeps working, because migrations are
/// additive. The control: sqlx's default migrator, strict about unknown
/// versions, refuses the same schema.
#[tokio::test]
async fn a_schema_migrated_by_a_newer_release_still_opens() {
    use idemkit_core::{ClaimOutcome, KeyStore};
    use idemkit_testkit::suite::{claim_req, scope};
    let Some(url) = database_url() else {
        return;
    };
    let config = PgConfig::default()
        .with_schema(fresh_schema())
        .with_max_connections(2);
    let store = PgStore::connect_with(&url, config.clone()).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (99991231000001, 'from a newer release', TRUE, '\\x00', 0)",
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
    let store = PgStore::connect_with(&url, config)
        .await
        .expect("a newer release's migration does not stop this one");
    let s = scope("a", "after-newer");
    assert!(matches!(
        store.claim(&claim_req(&s, "{}")).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
}

/// Parking wakes a waiter at once (its next claim answers `Parked`), as
/// completing, releasing and abandoning do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_wakes_waiters() {
    use idemkit_core::{ClaimOutcome, KeyStore};
    use idemkit_testkit::suite::{claim_req, must_claim, scope};
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let s = scope("a", "park-wake");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&*store, &req).await;
    let started = std::time::Instant::now();
    let waiter = tokio::spawn({
        let (store, s) = (store.clone(), s.clone());
        async move { store.wait_for_change(&s, Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.park(&s, lease.token, "review").await.unwrap();
    waiter.await.unwrap().unwrap();
    let woke = started.elapsed();
    assert!(
        woke >= Duration::from_millis(190) && woke < Duration::from_secs(3),
        "woken by the park's notification, not before it: {woke:?}"
    );
    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Parked);
}

/// A single-step claim of an absent key has no row until it completes (the
/// record is written, completed, with the `COMMIT`), so a phase cannot advance
/// inside it, as on SQLite; the claim can still complete.
#[tokio::test]
async fn advance_inside_a_single_step_claim_is_refused() {
    use idemkit_core::{KeyStore, PhaseUpdate, StoreError, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, response, scope};
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let s = scope("a", "single-step-phase");
    let TxClaim::Claimed { mut tx, lease } = store.claim_in_tx(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("claims")
    };
    let update = PhaseUpdate {
        recovery_point: "p".into(),
        step: Some(("s".into(), serde_json::json!({"n": 1}))),
    };
    let refused = store.advance_in_tx(&mut tx, &s, lease.token, &update).await;
    assert!(matches!(refused, Err(StoreError::Unsupported(_))), "{refused:?}");
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap();
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.recovery_point, None);
    assert_eq!(rec.response, Some(response(201, "ok")));
}

/// A schema name that is not a plain identifier (it is formatted into SQL) is
/// refused before any connection is made, by `connect` and `from_pool`
/// alike: the error names the schema rule, where a connection
/// attempt to the closed port below would be `Unavailable`.
#[tokio::test]
async fn invalid_schema_names_are_refused() {
    use idemkit_core::StoreError;
    // Nothing listens here: an attempt to connect is `Unavailable`.
    const CLOSED: &str = "postgres://nobody@127.0.0.1:1/none";
    let config = |schema: &str| {
        PgConfig::default()
            .with_schema(schema)
            .with_acquire_timeout(Duration::from_millis(300))
    };
    let refused = |what: &str, schema: &str, r: Result<PgStore, StoreError>| match r {
        Err(StoreError::Config(e)) => assert_eq!(
            e.downcast_ref::<idemkit_postgres::PgConfigError>(),
            Some(&idemkit_postgres::PgConfigError::BadSchema(schema.to_owned())),
            "{what}({schema:?}): {e}"
        ),
        Err(e) => panic!("{what}({schema:?}): not the schema error: {e:?}"),
        Ok(_) => panic!("{what}({schema:?}) accepted"),
    };
    let lazy = || {
        sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(300))
            .connect_lazy(CLOSED)
            .unwrap()
    };
    for schema in [
        "x; DROP TABLE y",
        "Upper",
        "1t",
        "a-b",
        "",
        "a b",
        &"a".repeat(64),
    ] {
        let started = std::time::Instant::now();
        refused(
            "connect",
            schema,
            PgStore::connect_with(CLOSED, config(schema)).await,
        );
        refused(
            "from_pool",
            schema,
            PgStore::from_pool(lazy(), config(schema)).await,
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "refused without trying the network"
        );
    }
    // The control: a valid name gets as far as the network, and fails there.
    for r in [
        PgStore::connect_with(CLOSED, config("valid_name")).await,
        PgStore::from_pool(lazy(), config("valid_name")).await,
    ] {
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
    }
}

/// A connection that cannot be made is `Unavailable` (a retryable 503), not a
/// generic failure.
#[tokio::test]
async fn unreachable_database_is_unavailable() {
    let config = PgConfig::default().with_acquire_timeout(Duration::from_millis(500));
    let err = PgStore::connect_with("postgres://nobody@127.0.0.1:1/none", config)
        .await
        .unwrap_err();
    assert!(matches!(err, idemkit_core::StoreError::Unavailable(_)), "{err:?}");
    // Printed as a chain, the cause appears once (the kind does not repeat it).
    let source = std::error::Error::source(&err).expect("the cause").to_string();
    let chain = format!("{:#}", anyhow::Error::new(err));
    assert!(chain.starts_with("key store unavailable: "), "{chain}");
    assert_eq!(chain.matches(source.as_str()).count(), 1, "{chain}");
}

/// A URL sqlx cannot parse is a configuration error (not retryable), found
/// before anything is sent; a zero pool or attempt count too.
#[tokio::test]
async fn a_malformed_url_or_setting_is_a_configuration_error() {
    use idemkit_core::StoreError;
    use idemkit_postgres::PgConfigError;
    for url in ["not a url", "postgres://app@127.0.0.1:notaport/app"] {
        match PgStore::connect(url).await {
            Err(e @ StoreError::Config(_)) => {
                assert!(!e.is_retryable());
                let StoreError::Config(source) = &e else {
                    unreachable!()
                };
                assert!(
                    matches!(
                        source.downcast_ref::<PgConfigError>(),
                        Some(PgConfigError::BadUrl(_))
                    ),
                    "{url}: {source:?}"
                );
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    for (config, expected) in [
        (
            PgConfig::default().with_max_connections(0),
            PgConfigError::NoConnections,
        ),
        (
            PgConfig::default().with_max_attempts(0),
            PgConfigError::NoAttempts,
        ),
    ] {
        match PgStore::connect_with("postgres://nobody@127.0.0.1:1/none", config).await {
            Err(StoreError::Config(source)) => {
                assert_eq!(source.downcast_ref::<PgConfigError>(), Some(&expected));
            }
            other => panic!("{expected:?}: {other:?}"),
        }
    }
}

/// Waiters are woken by LISTEN/NOTIFY when the holder completes, not by a poll
/// interval; with nothing happening they wait out their bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_by_notifications() {
    use idemkit_core::KeyStore;
    use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    assert!(store.notifies_changes());
    let s = scope("a", "wake");
    let lease = must_claim(&*store, &claim_req(&s, "{}")).await;

    let started = std::time::Instant::now();
    let waiter = tokio::spawn({
        let (store, s) = (store.clone(), s.clone());
        async move { store.wait_for_change(&s, Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .unwrap();
    waiter.await.unwrap().unwrap();
    let woke = started.elapsed();
    assert!(
        woke < Duration::from_secs(3),
        "woken after {woke:?}, not by the notification"
    );

    // Nothing changes (a live holder works on): the wait ends at its bound.
    let quiet = scope("a", "quiet");
    must_claim(&*store, &claim_req(&quiet, "{}")).await;
    let started = std::time::Instant::now();
    store
        .wait_for_change(&quiet, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(290));
}

/// A duplicate claim (`waiting`, spawned) that waits on the winner's lock: it
/// is still waiting 300 ms on, and once the winner completes with `201 won`
/// it replays that.
async fn waits_then_replays(
    store: &PgStore,
    waiting: tokio::task::JoinHandle<idemkit_core::TxClaim<idemkit_postgres::PgTx>>,
    tx: idemkit_postgres::PgTx,
    s: &idemkit_core::Scope,
    token: idemkit_core::FencingToken,
) {
    use idemkit_core::{ClaimOutcome, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::response;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the duplicate waits for the winner");
    store
        .complete_in_tx(tx, s, token, &response(201, "won"))
        .await
        .unwrap();
    match waiting.await.unwrap() {
        TxClaim::Other(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "won")),
        other => panic!("expected replay, got {other:?}"),
    }
}

/// In-flight = reject on single-step: a duplicate arriving while the winner's
/// claim is uncommitted answers in progress at once (its try-lock fails); it
/// neither waits for the winner nor holds a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_step_duplicate_is_rejected_quickly_while_winner_runs() {
    use idemkit_core::{ClaimOutcome, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, scope};
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let s = scope("a", "busy");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { tx, lease } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("winner")
    };
    let started = std::time::Instant::now();
    match store.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::InProgress { .. }) => {}
        other => panic!("expected in progress, got {other:?}"),
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "rejected after {took:?}");
    // With a wait, the duplicate blocks on the winner's lock and then reads,
    // with a snapshot taken after it, the committed record: a replay.
    let waiting = tokio::spawn({
        let (store, mut req) = (store.clone(), req.clone());
        req.lock_wait = Duration::from_secs(10);
        async move { store.claim_in_tx(&req).await.unwrap() }
    });
    waits_then_replays(&store, waiting, tx, &s, lease.token).await;
}

/// `PgConfig::reject_lock_timeout` grants the in-flight = reject duplicate a
/// wait: an instance that has never seen the key (so its opening is the
/// absence check, in its waiting form) blocks on the winner's lock, then fails
/// the check against the committed record and replays it. The control is the
/// default instance, which answers in progress at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_reject_wait_lets_a_duplicate_replay_the_winner() {
    use idemkit_core::{ClaimOutcome, TransactionalStore, TxClaim};
    use idemkit_testkit::suite::{claim_req, scope};
    let Some(store) = store_in_fresh_schema(None).await else {
        return;
    };
    let url = database_url().expect("the store above connected");
    let instance = |reject_lock_timeout| {
        let url = url.clone();
        let schema = store.config().schema().to_owned();
        async move {
            let config = PgConfig::default()
                .with_schema(schema)
                .with_reject_lock_timeout(reject_lock_timeout);
            Arc::new(PgStore::connect_with(&url, config).await.expect("connect"))
        }
    };
    let (patient, impatient) = (
        instance(Duration::from_secs(10)).await,
        instance(Duration::ZERO).await,
    );
    let s = scope("a", "patient");
    let req = claim_req(&s, "{}");
    let TxClaim::Claimed { tx, lease } = store.claim_in_tx(&req).await.unwrap() else {
        panic!("winner")
    };
    assert!(matches!(
        impatient.claim_in_tx(&req).await.unwrap(),
        TxClaim::Other(ClaimOutcome::InProgress { .. })
    ));
    let waiting = tokio::spawn({
        let req = req.clone();
        async move { patient.claim_in_tx(&req).await.unwrap() }
    });
    waits_then_replays(&store, waiting, tx, &s, lease.token).await;
}
