//! SQLite runs the store conformance suite, each test on a fresh database file.

use std::sync::Arc;

use async_trait::async_trait;
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_testkit::ManualClock;
use idemkit_testkit::tx_suite::BusinessProbe;

/// A fresh database in its own temporary directory (kept alive for the test).
async fn fresh(clock: Arc<ManualClock>) -> Arc<SqliteStore> {
    let dir = std::env::temp_dir().join(format!("idemkit-sqlite-test-{}", uuid_like()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteStore::open(dir.join("keys.db")).await.expect("open sqlite");
    Arc::new(store.with_clock(clock))
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

mod conformance {
    use super::*;
    idemkit_testkit::store_conformance_tests!(fresh);
}

mod transactional {
    use super::*;
    idemkit_testkit::transactional_conformance_tests!(fresh, probe);
}

#[tokio::test]
async fn opens_sqlite_urls_and_reopens_existing_files() {
    let dir = std::env::temp_dir().join(format!("idemkit-sqlite-url-{}", uuid_like()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("u.db");
    let url = format!("sqlite://{}", path.display());
    let a = SqliteStore::open(&url).await.expect("url form");
    drop(a);
    // Migrations are idempotent on reopen.
    let b = SqliteStore::open(&path).await.expect("path form");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(b.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
}
