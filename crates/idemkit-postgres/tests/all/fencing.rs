//! Fencing under a real pause: a holder process is stopped (SIGSTOP) inside its
//! completing transaction (after `begin_fenced` and its business write, before
//! `complete_in_tx`), its lease expires, another attempt takes over and
//! completes; the resumed holder's completion is refused and its business
//! write rolls back with it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use idemkit_core::{
    Account, ClaimOutcome, ClaimRequest, Fingerprinter, IdempotencyKey, KeyStore, Scope, StoredRequest,
    StoredResponse, TransactionalStore,
};

use crate::{database_url, fresh_schema};

fn signal(pid: u32, sig: &str) {
    assert!(
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_holder_cannot_complete_after_takeover() {
    let Some(url) = database_url() else { return };
    let schema = fresh_schema();
    let config = idemkit_postgres::PgConfig::default().with_schema(schema.clone());
    let store = idemkit_postgres::PgStore::connect_with(&url, config)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();

    let lease_ms = 300;
    let mut holder = Command::new(idemkit_testkit::example_bin("pg_holder"))
        .args([&url, &schema, "paused-key", &lease_ms.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(holder.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "claimed 1", "holder A claimed");

    line.clear();
    out.read_line(&mut line).unwrap();
    let backend: i32 = line
        .trim()
        .strip_prefix("in-tx ")
        .unwrap_or_else(|| panic!("holder A at its failpoint: {line:?}"))
        .parse()
        .unwrap();

    // A is stopped for real, inside its open transaction, past its lease.
    signal(holder.id(), "-STOP");
    tokio::time::sleep(Duration::from_millis(lease_ms * 3)).await;
    let (state, in_tx): (String, bool) =
        sqlx::query_as("SELECT state, xact_start IS NOT NULL FROM pg_stat_activity WHERE pid = $1")
            .bind(backend)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), in_tx),
        ("idle in transaction", true),
        "A is paused with its transaction open"
    );

    let count = |tag: &'static str| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM biz WHERE tag = $1")
                .bind(tag)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // B takes over (new fencing token) and completes with its business row.
    let scope = Scope::new(
        Account::new("holder"),
        IdempotencyKey::parse("paused-key").unwrap(),
    );
    let req = ClaimRequest {
        scope: scope.clone(),
        fingerprint: Fingerprinter::new().compute("POST", "/op", b"{}"),
        request: StoredRequest {
            method: "POST".into(),
            path: "/op".into(),
            headers: vec![],
            body: b"{}".to_vec(),
        },
        lease: Duration::from_millis(lease_ms),
        replay_window: Duration::from_secs(3600),
        lock_wait: Duration::ZERO,
        resume: None,
        recovery_point: None,
    };
    let ClaimOutcome::Claimed(b) = store.claim(&req).await.unwrap() else {
        panic!("B takes over")
    };
    assert!(b.token.0 >= 2, "a takeover is a fresh token: {b:?}");
    let mut tx = store.begin_fenced(&scope, b.token).await.unwrap();
    sqlx::query("INSERT INTO biz (tag) VALUES ('holder-b')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let b_response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"B".to_vec(),
    };
    store
        .complete_in_tx(tx, &scope, b.token, &b_response)
        .await
        .unwrap();

    assert_eq!(count("holder-a").await, 0, "A's write is not committed");

    // A resumes and goes on from its failpoint: its completion, in the
    // transaction that holds its business write.
    signal(holder.id(), "-CONT");
    holder.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let status = holder.wait().unwrap();
    assert_eq!(line.trim(), "fenced", "A's completion must be refused");
    assert_eq!(status.code(), Some(3));

    assert_eq!(count("holder-a").await, 0, "A's business write rolled back");
    assert_eq!(count("holder-b").await, 1);
    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Replay(b_response));
}
