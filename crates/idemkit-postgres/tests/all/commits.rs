//! Lease mode costs phases + 1 commits per request (the claim, then one per
//! phase, the last storing the response with it), counted by the server:
//! `pg_stat_database.xact_commit` of a database created for the test.
//!
//! Commits are read after the pool closes (a backend flushes its statistics
//! when it exits), for two run lengths, so the constant cost of connecting and
//! migrating cancels out: commits/request = Δcommits ÷ Δrequests.

use std::time::Duration;

use idemkit_core::{ClaimOutcome, KeyStore, StoredResponse, TransactionalStore};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_testkit::suite::{claim_req, scope};
use sqlx::Connection;

use crate::database_url;

async fn commits(admin: &mut sqlx::PgConnection, db: &str) -> i64 {
    // Backends that just exited may still be flushing their counters.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *admin)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(&mut *admin)
        .await
        .unwrap()
}

/// `requests` lease-mode requests of `phases` phases, each phase one fenced
/// transaction with a business row; the last phase completes.
async fn run(url: &str, phases: usize, requests: usize, tag: &str) {
    let store = PgStore::connect_with(
        url,
        PgConfig::default().with_schema("commits").with_max_connections(2),
    )
    .await
    .unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    for i in 0..requests {
        let s = scope("commits", &format!("{tag}-{i}"));
        let ClaimOutcome::Claimed(lease) = store.claim(&claim_req(&s, "{}")).await.unwrap() else {
            panic!("a fresh key is claimed")
        };
        for p in 0..phases {
            let mut tx = store.begin_fenced(&s, lease.token).await.unwrap();
            sqlx::query("INSERT INTO biz (tag) VALUES ('x')")
                .execute(&mut *tx)
                .await
                .unwrap();
            if p + 1 == phases {
                let response = StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: b"ok".to_vec(),
                };
                store
                    .complete_in_tx(tx, &s, lease.token, &response)
                    .await
                    .unwrap();
            } else {
                store.commit(tx).await.unwrap();
            }
        }
    }
    // Dropping the store stops its notification listener, whose connection the
    // pool would otherwise wait for.
    let pool = store.pool().clone();
    drop(store);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_commits_phases_plus_one_per_request() {
    let Some(base) = database_url() else { return };
    let db = format!("idemkit_commits_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let (prefix, _) = base.rsplit_once('/').unwrap();
    let url = format!("{prefix}/{db}");

    // The first run creates the schema and runs the migrations: not counted.
    run(&url, 1, 1, "warm-up").await;
    let (short, long) = (3, 13);
    let mut measured = Vec::new();
    for phases in 1..=3 {
        let c0 = commits(&mut admin, &db).await;
        run(&url, phases, short, &format!("s{phases}")).await;
        let c1 = commits(&mut admin, &db).await;
        run(&url, phases, long, &format!("l{phases}")).await;
        let c2 = commits(&mut admin, &db).await;
        let per_request = ((c2 - c1) - (c1 - c0)) as f64 / (long - short) as f64;
        measured.push((phases, per_request));
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {db} WITH (FORCE)")))
        .execute(&mut admin)
        .await
        .unwrap();
    for (phases, per_request) in measured {
        // A commit more or less per request is a whole 1.0 off; the slack is for
        // a stray background transaction (autovacuum) in one of the runs.
        assert!(
            (per_request - (phases as f64 + 1.0)).abs() < 0.25,
            "{phases} phase(s): {per_request:.2} commits per request, expected {}",
            phases + 1
        );
    }
}
