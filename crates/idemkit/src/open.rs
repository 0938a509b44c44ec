//! [`open_store`]: one way to open a key store from a URL, for every binary,
//! service and example that takes its store from configuration.
//!
//! | URL | store | feature |
//! |-----|-------|---------|
//! | `sqlite://PATH`, `sqlite:PATH` or a plain file path | [`SqliteStore`](crate::stores::sqlite::SqliteStore) | `sqlite` |
//! | `postgres://…`, `postgresql://…` | [`PgStore`](crate::stores::postgres::PgStore) in [`OpenOptions::pg_schema`] | `postgres` |
//! | `redis://…`, `rediss://…`, `redis+unix://…` | [`RedisStore`](crate::stores::redis::RedisStore), one node | `redis` |
//! | `redis+cluster://host:port,host:port` | [`RedisStore`](crate::stores::redis::RedisStore) on a cluster (seed nodes) | `redis` |
//!
//! The result keeps the concrete store ([`OpenedStore`]), because single-step
//! handlers need the SQL store's own transactions, and offers the
//! `Arc<dyn KeyStore>` view ([`OpenedStore::key_store`]) for everything else.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemkit::OpenError> {
//! let opened = idemkit::open_store("sqlite://keys.db", &idemkit::OpenOptions::new()).await?;
//! let keys = opened.key_store();
//! # let _ = keys; Ok(()) }
//! ```

use std::fmt;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
use std::sync::Arc;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
use idemkit_core::KeyStore;

/// The kind of store a URL names, decided by its scheme alone (no feature
/// needed): `postgres:`/`postgresql:` and `redis:`/`rediss:`/`redis+unix:`/
/// `redis+cluster:` name servers; anything else is SQLite (a `sqlite:` URL or a
/// file path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreKind {
    /// The embedded SQLite store.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// Redis or Redis Cluster.
    Redis,
}

impl StoreKind {
    /// The kind of store `url` names.
    pub fn of(url: &str) -> Self {
        const POSTGRES: [&str; 2] = ["postgres:", "postgresql:"];
        const REDIS: [&str; 4] = ["redis:", "rediss:", "redis+unix:", "redis+cluster:"];
        if POSTGRES.iter().any(|p| url.starts_with(p)) {
            Self::Postgres
        } else if REDIS.iter().any(|p| url.starts_with(p)) {
            Self::Redis
        } else {
            Self::Sqlite
        }
    }

    /// The product's name: `SQLite`, `PostgreSQL` or `Redis`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "SQLite",
            Self::Postgres => "PostgreSQL",
            Self::Redis => "Redis",
        }
    }

    /// The facade feature that brings this store in.
    pub const fn feature(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::Redis => "redis",
        }
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What opening may do to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OpenMode {
    /// Create what is missing (the SQLite file, the PostgreSQL schema) and run
    /// the migrations: what a service does at start.
    #[default]
    Create,
    /// An existing store only, brought up to date by its migrations: a SQLite
    /// path must name an existing file (nothing is invented); PostgreSQL opens
    /// with [`PgStore::connect`](crate::stores::postgres::PgStore::connect).
    Existing,
    /// An existing store, with no DDL and no migrations where the backend
    /// allows it: PostgreSQL opens with
    /// [`PgStore::connect_existing`](crate::stores::postgres::PgStore::connect_existing)
    /// (an error when the schema holds no store or needs a migration); a SQLite
    /// path must name an existing file (SQLite's embedded migrations, which are
    /// idempotent, still run). For read-only operator commands.
    NoMigrations,
}

/// Settings for [`open_store`]; each applies only to the stores it names.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OpenOptions {
    /// What opening may change (default [`OpenMode::Create`]).
    pub mode: OpenMode,
    /// PostgreSQL: the schema holding the store (default `idemkit`).
    pub pg_schema: String,
    /// SQL stores: the pool size (default: each store's own, SQLite 8, PostgreSQL 5).
    pub max_connections: Option<u32>,
    /// Redis: the key prefix (default: the store's, `idemkit`).
    pub redis_prefix: Option<String>,
    /// SQLite: which commits wait for the disk (default
    /// [`Durability::Normal`](crate::stores::sqlite::Durability::Normal)).
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub sqlite_durability: crate::stores::sqlite::Durability,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            mode: OpenMode::Create,
            pg_schema: "idemkit".to_owned(),
            max_connections: None,
            redis_prefix: None,
            #[cfg(feature = "sqlite")]
            sqlite_durability: crate::stores::sqlite::Durability::Normal,
        }
    }
}

impl OpenOptions {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets what opening may change.
    pub fn with_mode(mut self, mode: OpenMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the PostgreSQL schema.
    pub fn with_pg_schema(mut self, schema: impl Into<String>) -> Self {
        self.pg_schema = schema.into();
        self
    }

    /// Sets the pool size of a SQL store.
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = Some(n);
        self
    }

    /// Sets the Redis key prefix.
    pub fn with_redis_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.redis_prefix = Some(prefix.into());
        self
    }

    /// Sets which commits of a SQLite store wait for the disk.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub fn with_sqlite_durability(mut self, durability: crate::stores::sqlite::Durability) -> Self {
        self.sqlite_durability = durability;
        self
    }
}

/// Why [`open_store`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// [`OpenMode::Existing`] or [`OpenMode::NoMigrations`] and no file at the path.
    #[error("no SQLite database at `{0}`")]
    NoSqliteFile(String),
    /// The URL names a store whose facade feature is off.
    #[error("{kind} key stores need the `{}` feature of idemkit", kind.feature())]
    FeatureDisabled {
        /// The store the URL names.
        kind: StoreKind,
    },
    /// The store could not be opened (unreachable, bad URL, schema, migration).
    #[error("opening the {kind} key store")]
    Store {
        /// The store the URL names.
        kind: StoreKind,
        /// The store's error.
        #[source]
        source: idemkit_core::StoreError,
    },
}

/// An opened store: the concrete type (for single-step transactions and the
/// application's own queries on the same pool) and, through
/// [`key_store`](Self::key_store), the object-safe view.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum OpenedStore {
    /// SQLite.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    Sqlite(Arc<crate::stores::sqlite::SqliteStore>),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    Postgres(Arc<crate::stores::postgres::PgStore>),
    /// Redis or Redis Cluster.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    Redis(Arc<crate::stores::redis::RedisStore>),
}

impl OpenedStore {
    /// Which store this is.
    pub fn kind(&self) -> StoreKind {
        match *self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(_) => StoreKind::Sqlite,
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => StoreKind::Postgres,
            #[cfg(feature = "redis")]
            Self::Redis(_) => StoreKind::Redis,
        }
    }

    /// The store as an `Arc<dyn KeyStore>` (sharing the same handle).
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
    pub fn key_store(&self) -> Arc<dyn KeyStore> {
        match *self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(ref s) => s.clone(),
            #[cfg(feature = "postgres")]
            Self::Postgres(ref s) => s.clone(),
            #[cfg(feature = "redis")]
            Self::Redis(ref s) => s.clone(),
        }
    }
}

/// Opens the key store `url` names, as `options` allow. A store whose feature
/// is off is an [`OpenError::FeatureDisabled`], never a silent fallback to
/// another store.
///
/// | URL | store | feature |
/// |-----|-------|---------|
/// | `sqlite://PATH`, `sqlite:PATH` or a plain file path | [`SqliteStore`](crate::stores::sqlite::SqliteStore) | `sqlite` |
/// | `postgres://…`, `postgresql://…` | [`PgStore`](crate::stores::postgres::PgStore) in [`OpenOptions::pg_schema`] | `postgres` |
/// | `redis://…`, `rediss://…`, `redis+unix://…` | [`RedisStore`](crate::stores::redis::RedisStore), one node | `redis` |
/// | `redis+cluster://host:port,host:port` | [`RedisStore`](crate::stores::redis::RedisStore) on a cluster (seed nodes) | `redis` |
pub async fn open_store(url: &str, options: &OpenOptions) -> Result<OpenedStore, OpenError> {
    let kind = StoreKind::of(url);
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
    let store_err = |source| OpenError::Store { kind, source };
    match kind {
        #[cfg(feature = "sqlite")]
        StoreKind::Sqlite => {
            // Opening creates a missing file: an operator tool must not invent an
            // empty store. A `sqlite:` URL carries its own options and is not checked.
            if options.mode != OpenMode::Create
                && !url.starts_with("sqlite:")
                && !std::path::Path::new(url).exists()
            {
                return Err(OpenError::NoSqliteFile(url.to_owned()));
            }
            let mut config =
                crate::stores::sqlite::SqliteConfig::default().with_durability(options.sqlite_durability);
            if let Some(n) = options.max_connections {
                config = config.with_max_connections(n);
            }
            let store = crate::stores::sqlite::SqliteStore::connect_with(url, config)
                .await
                .map_err(store_err)?;
            Ok(OpenedStore::Sqlite(Arc::new(store)))
        }
        #[cfg(feature = "postgres")]
        StoreKind::Postgres => {
            use crate::stores::postgres::{PgConfig, PgStore};
            let mut config = PgConfig::default().with_schema(options.pg_schema.clone());
            if let Some(n) = options.max_connections {
                config = config.with_max_connections(n);
            }
            let store = match options.mode {
                OpenMode::Create | OpenMode::Existing => PgStore::connect_with(url, config).await,
                OpenMode::NoMigrations => PgStore::connect_existing(url, config).await,
            }
            .map_err(store_err)?;
            Ok(OpenedStore::Postgres(Arc::new(store)))
        }
        #[cfg(feature = "redis")]
        StoreKind::Redis => {
            use crate::stores::redis::{RedisConfig, RedisStore};
            let mut config = RedisConfig::default();
            if let Some(prefix) = &options.redis_prefix {
                config = config.with_prefix(prefix.clone());
            }
            let store = RedisStore::connect_with(url, config).await.map_err(store_err)?;
            Ok(OpenedStore::Redis(Arc::new(store)))
        }
        #[allow(unreachable_patterns)] // only reachable with a store feature off
        kind => {
            let _ = options;
            Err(OpenError::FeatureDisabled { kind })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_decides_the_store() {
        for (url, kind) in [
            ("postgres://app@127.0.0.1/app", StoreKind::Postgres),
            ("postgresql://app@db/app", StoreKind::Postgres),
            ("redis://127.0.0.1:6379", StoreKind::Redis),
            ("rediss://cache:6380/1", StoreKind::Redis),
            ("redis+cluster://10.0.0.1:7000,10.0.0.2:7000", StoreKind::Redis),
            ("sqlite:///tmp/keys.db", StoreKind::Sqlite),
            ("sqlite::memory:", StoreKind::Sqlite),
            ("keys.db", StoreKind::Sqlite),
            ("/var/lib/app/postgres.db", StoreKind::Sqlite),
        ] {
            assert_eq!(StoreKind::of(url), kind, "{url}");
        }
    }
}
