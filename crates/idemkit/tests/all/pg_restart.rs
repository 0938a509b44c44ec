//! A database restart during load, on a private PostgreSQL cluster this test
//! creates (`initdb`, its own port, stopped with `pg_ctl -m immediate`): no
//! request answered 2xx loses its order, and no key stays stuck beyond its lease.
//! That is asserted directly: right after the restart every in-flight record's
//! lease ends within lease + heartbeat of the store's clock, and every key a
//! client was sending when the database went down is answered 2xx within
//! lease + heartbeat + a reconnection margin of the restart.
//! Runs in nextest's serial `pg-cluster` group (see `.config/nextest.toml`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use idemkit_testkit::PgServer;

use crate::{Backend, Server, order};

/// Keys each of the 8 client workers sends, one after another.
const KEYS_PER_WORKER: usize = 120;

/// The server's lease (`IDEMKIT_LEASE_MS`).
const LEASE: Duration = Duration::from_millis(1000);

/// A live holder extends its lease every lease / 3 (`Policy::heartbeat_interval`).
const HEARTBEAT: Duration = Duration::from_millis(1000 / 3);

/// Time after the restart for the server's pool to reconnect and a client's
/// retry (every 100 ms) to get through, on top of lease + heartbeat.
const RECONNECT_MARGIN: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_restart_under_load_loses_no_acknowledged_order() {
    let Some(cluster) = PgServer::start(&["fsync=on"]) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "PostgreSQL server binaries (initdb, pg_ctl) are not installed: install `postgresql`"
        );
        eprintln!("no PostgreSQL server binaries: skipping");
        return;
    };
    let backend = Backend::Postgres {
        url: cluster.url("postgres"),
        schema: "restart".into(),
    };
    let lease_ms = LEASE.as_millis().to_string();
    let server = Server::start_on(&backend, &[("IDEMKIT_LEASE_MS", &lease_ms)]).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();

    // Each worker sends its keys one after another, retrying a key (same key,
    // same body) until it is answered 2xx, as a client following SPEC §8 would.
    let acknowledged: Arc<Mutex<HashMap<String, i64>>> = Arc::default();
    // Per key: when its first attempt was sent and when it was answered 2xx.
    let timeline: Arc<Mutex<HashMap<String, (Instant, Instant)>>> = Arc::default();
    let failures = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(60);
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (client, base, acknowledged, failures, timeline) = (
                client.clone(),
                server.base.clone(),
                acknowledged.clone(),
                failures.clone(),
                timeline.clone(),
            );
            tokio::spawn(async move {
                for i in 0..KEYS_PER_WORKER {
                    let key = format!("restart-{w}-{i}");
                    let first_sent = Instant::now();
                    loop {
                        assert!(Instant::now() < deadline, "key {key} stuck: never answered 2xx");
                        let sent = client
                            .post(format!("{base}/orders"))
                            .bearer_auth("restart")
                            .header("idempotency-key", &key)
                            .json(&order("R", 1))
                            .send()
                            .await;
                        match sent {
                            Ok(res) if res.status().is_success() => {
                                let body: serde_json::Value = res.json().await.unwrap();
                                acknowledged
                                    .lock()
                                    .await
                                    .insert(key.clone(), body["id"].as_i64().unwrap());
                                timeline
                                    .lock()
                                    .await
                                    .insert(key.clone(), (first_sent, Instant::now()));
                                break;
                            }
                            Ok(res) => {
                                let status = res.status().as_u16();
                                assert!(
                                    matches!(status, 409 | 500 | 503),
                                    "key {key}: unexpected {status}"
                                );
                                failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(_) => {
                                failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        })
        .collect();

    let started_at = |url: String| async move {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let t: String = sqlx::query_scalar("SELECT pg_postmaster_start_time()::text")
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        t
    };
    let first_start = started_at(cluster.url("postgres")).await;
    // Crash well inside the load: each worker needs over a second for its keys.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = acknowledged.lock().await.len();
    cluster.crash();
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.start_again();
    let restarted_at = Instant::now();

    // Right after the restart, by the store's clock: no in-flight record holds
    // a lease ending later than lease + heartbeat from now (a holder that died
    // with the connection cannot have extended it; a live one extends it to at
    // most now + lease).
    let keys_pool = sqlx::PgPool::connect(&cluster.url("postgres")).await.unwrap();
    let (now_ms, in_flight): (i64, Vec<(String, i64)>) = {
        let now: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint")
            .fetch_one(&keys_pool)
            .await
            .unwrap();
        let rows = sqlx::query_as(
            "SELECT idem_key, lease_expires_at FROM restart.idemkit_keys WHERE state = 'in_flight'",
        )
        .fetch_all(&keys_pool)
        .await
        .unwrap();
        (now, rows)
    };
    keys_pool.close().await;
    let bound = i64::try_from((LEASE + HEARTBEAT).as_millis()).unwrap();
    for (key, expires) in &in_flight {
        assert!(
            *expires <= now_ms + bound,
            "key {key}: in flight after the restart with a lease ending {} ms from now, beyond lease + heartbeat ({bound} ms)",
            expires - now_ms
        );
    }

    for w in workers {
        w.await.unwrap();
    }

    let acknowledged = acknowledged.lock().await.clone();
    assert_eq!(
        acknowledged.len(),
        8 * KEYS_PER_WORKER,
        "every key was eventually answered 2xx"
    );
    assert!(
        before > 0 && before < 8 * KEYS_PER_WORKER,
        "the crash happened under load ({before} acknowledged before it)"
    );
    // The server really went down and came back (requests may only have waited for
    // the pool to reconnect, or failed and been retried; both are fine).
    assert_ne!(
        started_at(cluster.url("postgres")).await,
        first_start,
        "the database was restarted"
    );

    // Every key a client was sending before the restart (at most one per
    // worker was in flight when the database went down) was answered within
    // lease + heartbeat + the reconnection margin of the restart: none waited
    // for a lease that outlived its holder, let alone the 60 s deadline.
    let timeline = timeline.lock().await.clone();
    let limit = LEASE + HEARTBEAT + RECONNECT_MARGIN;
    let mut slowest = Duration::ZERO;
    for (key, (first_sent, acked)) in &timeline {
        if *first_sent < restarted_at {
            let after_restart = acked.saturating_duration_since(restarted_at);
            slowest = slowest.max(after_restart);
            assert!(
                after_restart <= limit,
                "key {key}: first sent before the restart, answered 2xx only {after_restart:?} after it (limit {limit:?})"
            );
        }
    }

    // Every acknowledged order exists, one per key.
    let pool = sqlx::PgPool::connect(&format!(
        "{}?options=-csearch_path%3Drestart",
        cluster.url("postgres")
    ))
    .await
    .unwrap();
    let account = idemkit::Account::keyed(crate::ACCOUNT_SECRET.as_bytes(), b"restart");
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM orders WHERE account = $1")
        .bind(account.as_str())
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        ids.len(),
        8 * KEYS_PER_WORKER,
        "one order per key, none lost, none doubled"
    );
    let ids: std::collections::HashSet<i64> = ids.into_iter().collect();
    for (key, id) in &acknowledged {
        assert!(ids.contains(id), "acknowledged order {id} of key {key} was lost");
    }
    eprintln!(
        "{before} keys acknowledged before the crash; all {} present after restart; {} attempts failed and were retried; \
         {} in flight right after the restart; the slowest key sent before it was answered {slowest:?} after it",
        acknowledged.len(),
        failures.load(std::sync::atomic::Ordering::Relaxed),
        in_flight.len()
    );
}
