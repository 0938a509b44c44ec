//! `idemkit check` against the quickstart example: a real process on loopback, on its
//! own SQLite file or a fresh PostgreSQL schema, must pass every gate.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{check_args, expect, idemkit};

/// A quickstart process on a free port with its own database; killed on drop.
struct Quickstart {
    child: Child,
    base: String,
    dir: PathBuf,
    /// The PostgreSQL schema, on PostgreSQL.
    schema: Option<String>,
}

/// Which store the quickstart process runs on.
enum Backend {
    /// Its own SQLite file.
    Sqlite,
    /// A fresh schema in the PostgreSQL database at this URL.
    Postgres(String),
}

impl Backend {
    /// PostgreSQL from `IDEMKIT_TEST_POSTGRES_URL`; `None` (skip) outside CI when it
    /// is not set, a failure under CI.
    fn postgres() -> Option<Self> {
        match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
            Ok(url) if !url.is_empty() => Some(Self::Postgres(url)),
            _ if std::env::var_os("CI").is_some() => panic!("IDEMKIT_TEST_POSTGRES_URL is not set under CI"),
            _ => {
                eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: skipping");
                None
            }
        }
    }
}

impl Quickstart {
    async fn start(backend: &Backend) -> Self {
        Self::start_with(backend, &[]).await
    }

    async fn start_with(backend: &Backend, env: &[(&str, &str)]) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let tag = format!("{}_{nanos}", std::process::id());
        let dir = std::env::temp_dir().join(format!("idemkit-check-{tag}"));
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let bin = tokio::task::spawn_blocking(|| idemkit_testkit::example_bin("quickstart"))
            .await
            .unwrap();
        let mut cmd = Command::new(bin);
        let schema = match backend {
            Backend::Sqlite => {
                cmd.env("IDEMKIT_DB", dir.join("quickstart.db"))
                    .env_remove("DATABASE_URL");
                None
            }
            Backend::Postgres(url) => {
                let schema = format!("check_{tag}");
                cmd.env("DATABASE_URL", url).env("IDEMKIT_PG_SCHEMA", &schema);
                Some(schema)
            }
        };
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .env("PORT", port.to_string())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn quickstart");
        let server = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
            schema,
        };
        // Ready once the count route answers (the store is open and migrated).
        let client = reqwest::Client::new();
        for _ in 0..400 {
            let probe = client
                .get(format!("{}/orders/count", server.base))
                .header("authorization", "Bearer probe")
                .send()
                .await;
            if probe.is_ok_and(|r| r.status().is_success()) {
                return server;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("quickstart did not start");
    }
}

impl Drop for Quickstart {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs every gate against a fresh quickstart; all pass except, where `in_progress`
/// allows it, the in-progress gate may be inconclusive.
async fn check_every_gate(backend: Backend, env: &[(&str, &str)], in_progress: &[&str]) {
    let server = Quickstart::start_with(&backend, env).await;
    let run = idemkit(check_args(&server.base, &["--json"])).await;
    let verdicts = run.verdicts();
    assert_eq!(verdicts.len(), 7, "{run:#?}");
    for (gate, verdict) in &verdicts {
        let allowed: &[&str] = if gate == "in-progress" {
            in_progress
        } else {
            &["pass"]
        };
        assert!(allowed.contains(&verdict.as_str()), "{gate}: {verdict}: {run:#?}");
    }
    let all_pass = verdicts.iter().all(|(_, v)| v == "pass");
    assert_eq!(run.code, if all_pass { 0 } else { 2 }, "{run:#?}");
    assert!(run.evidence("concurrency").contains("count 0 → 1"), "{run:#?}");
    assert!(
        run.evidence("mismatch").contains("409 idempotency_key_reused"),
        "{run:#?}"
    );

    // The table for people, on the same server (fresh keys, so the counts move on).
    let run = idemkit(check_args(&server.base, &["--gates", "1,2,3,5,6,7"])).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(
        run.stdout
            .contains("6 gate(s): 6 pass, 0 fail, 0 inconclusive → exit 0"),
        "{}",
        run.stdout
    );
}

/// SQLite with handlers that take a while (`IDEMKIT_HANDLER_DELAY_MS`): duplicates
/// that arrive while the winner runs are refused with
/// `409 idempotency_request_in_progress`, so every gate passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_sqlite_passes_every_gate() {
    check_every_gate(Backend::Sqlite, &[("IDEMKIT_HANDLER_DELAY_MS", "300")], &["pass"]).await;
}

/// SQLite with instant handlers: a duplicate may simply arrive after the winner
/// finished, so the in-progress gate may be inconclusive — never failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_sqlite_with_instant_handlers_never_fails_a_gate() {
    check_every_gate(Backend::Sqlite, &[], &["pass", "inconclusive"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_postgres_passes_every_gate_but_in_flight_is_unprovable() {
    if let Some(backend) = Backend::postgres() {
        check_every_gate(backend, &[], &["pass", "inconclusive"]).await;
    }
}

/// PostgreSQL with handlers that take a while (`IDEMKIT_HANDLER_DELAY_MS`):
/// duplicates of a running request find its lock held and are refused with
/// `409 idempotency_request_in_progress`, and all seven gates pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_postgres_with_slow_handlers_passes_every_gate() {
    if let Some(backend) = Backend::postgres() {
        check_every_gate(backend, &[("IDEMKIT_HANDLER_DELAY_MS", "300")], &["pass"]).await;
    }
}

/// PostgreSQL with the winner's commit held back (its order insert waits on a lock
/// the test holds on the business table): duplicates find the key's lock held
/// and are refused with `409 idempotency_request_in_progress`, and the
/// in-progress gate passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_postgres_refuses_duplicates_of_a_running_request() {
    use sqlx::Connection;

    let Some(backend) = Backend::postgres() else {
        return;
    };
    let Backend::Postgres(url) = &backend else {
        unreachable!()
    };
    let server = Quickstart::start(&backend).await;
    let schema = server.schema.clone().expect("a PostgreSQL schema");
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {schema}.orders IN SHARE MODE"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let check = tokio::spawn(idemkit(check_args(
        &server.base,
        &["--gates", "in-progress", "--json"],
    )));
    tokio::time::sleep(Duration::from_millis(800)).await;
    tx.commit().await.unwrap();
    let run = check.await.unwrap();
    assert_eq!(run.verdicts(), expect(&[("in-progress", "pass")]), "{run:#?}");
    assert_eq!(run.code, 0);
    let evidence = run.evidence("in-progress");
    assert!(
        evidence.contains("× 409 idempotency_request_in_progress (Retry-After"),
        "{evidence}"
    );
}

/// `IDEMKIT_KEYSTORE` (keys in Redis) with a PostgreSQL `DATABASE_URL` is refused
/// with a clear error instead of silently keeping the keys in PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_refuses_a_redis_keystore_with_postgres() {
    let bin = tokio::task::spawn_blocking(|| idemkit_testkit::example_bin("quickstart"))
        .await
        .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let database = std::env::var("IDEMKIT_TEST_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "postgres://nobody@127.0.0.1:1/none".into());
    let out = tokio::task::spawn_blocking(move || {
        let mut child = Command::new(bin)
            // A reachable database when there is one, so that ignoring the
            // combination would start a server (and time out here).
            .env("DATABASE_URL", database)
            .env("IDEMKIT_KEYSTORE", "redis://127.0.0.1:6379")
            .env("IDEMKIT_PG_SCHEMA", "quickstart_refused")
            .env("PORT", port.to_string())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                panic!("the quickstart kept running with IDEMKIT_KEYSTORE and a PostgreSQL DATABASE_URL");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("IDEMKIT_KEYSTORE")
            && stderr.contains("cannot be combined with a PostgreSQL DATABASE_URL"),
        "{stderr}"
    );
}
