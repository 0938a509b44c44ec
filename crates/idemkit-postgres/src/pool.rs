//! Opening the store: the pool (`search_path`, `statement_timeout`), the
//! schema and migrations, or a check that an existing store needs neither.

use std::str::FromStr;
use std::sync::Arc;

use idemkit_core::{StoreError, StoreResult, SystemClock};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::broadcast;

use crate::error::map_err;
use crate::listener::spawn_listener;
use crate::{MIGRATOR, PgConfig, PgConfigError, PgStore, sql};

impl PgStore {
    /// Connects to the database at `url` (`postgres://…`) with the default
    /// settings, creates the schema if needed and runs the migrations.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, PgConfig::default()).await
    }

    /// [`PgStore::connect`] with these settings.
    pub async fn connect_with(url: &str, config: PgConfig) -> StoreResult<Self> {
        let pool = Self::pool_for(url, &config).await?;
        Self::from_pool(pool, config).await
    }

    /// Connects to a store that already exists, with no DDL and no migrations:
    /// for read-only tools (`idemkit keys list`) pointed at a database they must
    /// never change, and for roles without `CREATE`. A schema without the key
    /// table, or with migrations still to run, is an error naming the problem.
    pub async fn connect_existing(url: &str, config: PgConfig) -> StoreResult<Self> {
        let pool = Self::pool_for(url, &config).await?;
        let applied: i64 = sqlx::query_scalar(sql::STORE_TABLES)
            .bind(&config.schema)
            .fetch_one(&pool)
            .await
            .map_err(map_err)?;
        if applied < 2 {
            return Err(StoreError::Backend(
                format!("schema `{}` holds no idemkit key store", config.schema).into(),
            ));
        }
        let done: Vec<i64> = sqlx::query_scalar(sql::APPLIED_MIGRATIONS)
            .fetch_all(&pool)
            .await
            .map_err(map_err)?;
        if let Some(missing) = MIGRATOR.iter().find(|m| !done.contains(&m.version)) {
            return Err(StoreError::Backend(
                format!(
                    "the key store in schema `{}` needs migration {} ({}); open it once with `PgStore::connect_with`",
                    config.schema, missing.version, missing.description
                )
                .into(),
            ));
        }
        Self::assemble(pool, config).await
    }

    async fn pool_for(url: &str, config: &PgConfig) -> StoreResult<PgPool> {
        config.validate()?;
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| PgConfigError::BadUrl(e.to_string()))?
            .options([
                ("search_path", format!("{}, public", config.schema)),
                (
                    "statement_timeout",
                    format!("{}", config.statement_timeout.as_millis()),
                ),
            ]);
        PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.acquire_timeout)
            .test_before_acquire(false)
            .before_acquire({
                let idle = config.ping_if_idle_for;
                move |conn, meta| {
                    Box::pin(async move {
                        if meta.idle_for >= idle {
                            conn.ping().await?;
                        }
                        Ok(true)
                    })
                }
            })
            .connect_with(options)
            .await
            .map_err(map_err)
    }

    /// Uses an existing pool whose connections already have `search_path` set
    /// to `<schema>, …` (as [`PgStore::connect_with`] does). The
    /// pool's own settings stand: of `config`, the schema and the store's
    /// settings apply, not the pool's (`max_connections`, the timeouts,
    /// `ping_if_idle_for`).
    pub async fn from_pool(pool: PgPool, config: PgConfig) -> StoreResult<Self> {
        config.validate()?;
        {
            // Concurrent `CREATE SCHEMA IF NOT EXISTS` can race in PostgreSQL;
            // serialise it across instances with an advisory lock.
            let mut tx = pool.begin().await.map_err(map_err)?;
            sqlx::query(sql::SCHEMA_LOCK)
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
            sqlx::query(AssertSqlSafe(sql::create_schema(&config)))
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
            tx.commit().await.map_err(map_err)?;
        }
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| StoreError::Backend(Box::new(e)))?;
        Self::assemble(pool, config).await
    }

    /// The store over a pool whose schema is ready: starts the listener.
    async fn assemble(pool: PgPool, config: PgConfig) -> StoreResult<Self> {
        let (changes, _) = broadcast::channel(1024);
        let listener = spawn_listener(&pool, config.schema.clone(), changes.clone()).await?;
        Ok(Self {
            pool,
            clock: Arc::new(SystemClock),
            test_clock: None,
            test_pause: None,
            config: Arc::new(config),
            recent: Arc::new(crate::recent::RecentKeys::new()),
            changes,
            _listener: Arc::new(listener),
        })
    }
}
