//! The courier's database: its idempotency keys and its shipments, side by side,
//! so a shipment row and the key's stored answer commit in one transaction.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use idemkit::{OpenOptions, OpenedStore, StoreKind};
use idemkit_postgres::PgStore;
use idemkit_sqlite::SqliteStore;

const SQLITE_TABLE: &str = "CREATE TABLE IF NOT EXISTS courier_shipments (\
     id INTEGER PRIMARY KEY AUTOINCREMENT, idem_key TEXT NOT NULL, reference TEXT, \
     request TEXT NOT NULL, created_at INTEGER NOT NULL)";

const PG_TABLE: &str = "CREATE TABLE IF NOT EXISTS courier_shipments (\
     id BIGSERIAL PRIMARY KEY, idem_key TEXT NOT NULL, reference TEXT, \
     request TEXT NOT NULL, created_at BIGINT NOT NULL)";

/// Serialises the DDL of courier instances starting together on one database.
const PG_DDL_LOCK: i64 = 7_345_243_913;

/// Where the shipments and keys live.
#[derive(Clone)]
pub(crate) enum Db {
    Sqlite(Arc<SqliteStore>),
    Postgres(Arc<PgStore>),
}

/// A directory the courier created for its default database, removed on drop.
#[derive(Debug)]
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    fn create() -> anyhow::Result<Self> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!(
            "idemkit-courier-{}-{nanos}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(dir))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An opened database: the store, a human description, and the temporary
/// directory to remove when the courier goes away (default database only).
pub(crate) struct Opened {
    pub(crate) db: Db,
    pub(crate) described: String,
    pub(crate) temp: Option<TempDir>,
}

/// Opens `url` (`postgres://…`, `sqlite://…` or a file path), or a fresh SQLite
/// file in a new temporary directory when `None`, and creates the shipments table.
pub(crate) async fn open(url: Option<&str>, pg_schema: &str) -> anyhow::Result<Opened> {
    let Some(url) = url else {
        let temp = TempDir::create()?;
        let file = temp.path().join("courier.db");
        let db = sqlite(&file.to_string_lossy()).await?;
        return Ok(Opened {
            db,
            described: format!("SQLite {} (temporary, removed on exit)", file.display()),
            temp: Some(temp),
        });
    };
    if StoreKind::of(url) != StoreKind::Postgres {
        return Ok(Opened {
            db: sqlite(url).await?,
            described: format!("SQLite {url}"),
            temp: None,
        });
    }
    let options = OpenOptions::new().with_pg_schema(pg_schema);
    let OpenedStore::Postgres(store) = idemkit::open_store(url, &options)
        .await
        .context("connecting to PostgreSQL")?
    else {
        unreachable!("a postgres:// URL opens PostgreSQL");
    };
    let mut tx = store.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(PG_DDL_LOCK)
        .execute(&mut *tx)
        .await?;
    sqlx::query(PG_TABLE).execute(&mut *tx).await?;
    tx.commit().await.context("creating the shipments table")?;
    Ok(Opened {
        db: Db::Postgres(store),
        described: format!("PostgreSQL schema {pg_schema}"),
        temp: None,
    })
}

/// Opens the SQLite database at `location` (a path or `sqlite:` URL; a Redis
/// URL is refused: shipments need SQL).
async fn sqlite(location: &str) -> anyhow::Result<Db> {
    let opened = idemkit::open_store(location, &OpenOptions::new())
        .await
        .with_context(|| format!("opening SQLite {location}"))?;
    let OpenedStore::Sqlite(store) = opened else {
        anyhow::bail!(
            "the courier keeps its shipments and keys in one SQL database; {} is not one",
            opened.kind()
        );
    };
    sqlx::query(SQLITE_TABLE)
        .execute(store.pool())
        .await
        .context("creating the shipments table")?;
    Ok(Db::Sqlite(store))
}

impl Db {
    /// Shipment rows ever created in this database.
    pub(crate) async fn count(&self) -> Result<i64, sqlx::Error> {
        const COUNT: &str = "SELECT COUNT(*) FROM courier_shipments";
        match self {
            Self::Sqlite(s) => sqlx::query_scalar(COUNT).fetch_one(s.pool()).await,
            Self::Postgres(s) => sqlx::query_scalar(COUNT).fetch_one(s.pool()).await,
        }
    }

    /// When shipment `n` was created (ms since the epoch), if it exists.
    pub(crate) async fn created_at(&self, n: i64) -> Result<Option<i64>, sqlx::Error> {
        match self {
            Self::Sqlite(s) => {
                sqlx::query_scalar("SELECT created_at FROM courier_shipments WHERE id = ?1")
                    .bind(n)
                    .fetch_optional(s.pool())
                    .await
            }
            Self::Postgres(s) => {
                sqlx::query_scalar("SELECT created_at FROM courier_shipments WHERE id = $1")
                    .bind(n)
                    .fetch_optional(s.pool())
                    .await
            }
        }
    }
}

/// A new shipment's columns.
pub(crate) struct NewShipment<'a> {
    pub(crate) key: &'a str,
    pub(crate) reference: Option<&'a str>,
    pub(crate) request: &'a str,
    pub(crate) created_at: i64,
}

/// Inserts a shipment in the claim's SQLite transaction; returns its number.
pub(crate) async fn insert_sqlite(
    conn: &mut sqlx::SqliteConnection,
    s: &NewShipment<'_>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO courier_shipments (idem_key, reference, request, created_at) \
         VALUES (?1, ?2, ?3, ?4) RETURNING id",
    )
    .bind(s.key)
    .bind(s.reference)
    .bind(s.request)
    .bind(s.created_at)
    .fetch_one(conn)
    .await
}

/// Inserts a shipment in the claim's PostgreSQL transaction; returns its number.
pub(crate) async fn insert_pg(
    conn: &mut sqlx::PgConnection,
    s: &NewShipment<'_>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO courier_shipments (idem_key, reference, request, created_at) \
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(s.key)
    .bind(s.reference)
    .bind(s.request)
    .bind(s.created_at)
    .fetch_one(conn)
    .await
}
