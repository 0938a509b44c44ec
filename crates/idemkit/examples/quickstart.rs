//! The quickstart: an orders API whose `POST /orders` is idempotent.
//!
//! ```text
//! cargo run --example quickstart            # SQLite file in the working directory, port 3000
//! PORT=4000 IDEMKIT_DB=/tmp/q.db cargo run --example quickstart
//! DATABASE_URL=sqlite:///tmp/q.db cargo run --example quickstart
//! DATABASE_URL=postgres://app@127.0.0.1/app cargo run --example quickstart
//! IDEMKIT_KEYSTORE=redis://127.0.0.1:6379 cargo run --example quickstart   # keys in Redis
//!
//! curl -s localhost:3000/orders -H 'Authorization: Bearer alice' \
//!   -H 'Idempotency-Key: order-confirm-42' -H 'Content-Type: application/json' \
//!   -d '{"sku":"BOOK-1","quantity":2}'
//! ```
//!
//! Routes:
//! - `POST /orders` requires `Idempotency-Key` and a bearer token (the token is the
//!   account keys are scoped by); body `{"sku": string, "quantity": integer ≥ 1}`;
//!   inserts one order row in the claim's own transaction; `201` with the order and
//!   a `Location` header. Retries with the same key replay that `201`.
//! - `GET /orders/count` answers `{"count": n}` for the caller's account.
//!
//! Environment: `PORT` (default 3000); `DATABASE_URL` (`sqlite://…` or
//! `postgres://…`), else `IDEMKIT_DB` (a SQLite file path, default
//! `idemkit-quickstart.db`); `IDEMKIT_PG_SCHEMA` (PostgreSQL schema, default
//! `idemkit`); `IDEMKIT_KEYSTORE` (`redis://…` or `redis+cluster://…`: keys in
//! Redis, in lease mode, while orders stay in the SQLite file; refused with a
//! PostgreSQL `DATABASE_URL`, whose keys live in PostgreSQL; `IDEMKIT_REDIS_PREFIX`
//! namespaces its keys, default `idemkit`); `IDEMKIT_LEASE_MS` (lease length, default 30000);
//! `IDEMKIT_HANDLER_DELAY_MS` (makes each order take that long inside its
//! transaction, to see duplicates of a running request answered
//! `409 idempotency_request_in_progress`; default 0).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use http::request::Parts;
use http::{StatusCode, header};
use idemkit::layer::IdempotencyLayerBuilder;
use idemkit::prelude::*;
use idemkit::{OpenOptions, OpenedStore, StoreKind, open_store};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

#[derive(Serialize)]
struct Order {
    id: i64,
    sku: String,
    quantity: i64,
}

impl NewOrder {
    fn validate(&self) -> Result<(), ProblemResponse> {
        if self.sku.trim().is_empty() || self.sku.len() > 100 {
            return Err(ProblemResponse::new(
                ErrorCode::ValidationFailed,
                "`sku` must be 1 to 100 characters",
            ));
        }
        if self.quantity < 1 {
            return Err(ProblemResponse::new(
                ErrorCode::ValidationFailed,
                "`quantity` must be an integer of at least 1",
            ));
        }
        Ok(())
    }

    fn created(self, id: i64) -> Response {
        let location = format!("/orders/{id}");
        let body = Order {
            id,
            sku: self.sku,
            quantity: self.quantity,
        };
        (
            StatusCode::CREATED,
            [(header::LOCATION, location)],
            axum::Json(body),
        )
            .into_response()
    }
}

/// Simulated work inside the order's transaction (`IDEMKIT_HANDLER_DELAY_MS`).
static HANDLER_DELAY: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

async fn simulated_work() {
    if let Some(d) = HANDLER_DELAY.get().filter(|d| !d.is_zero()) {
        tokio::time::sleep(*d).await;
    }
}

fn internal(e: sqlx::Error) -> ProblemResponse {
    match e {
        // The database went away or is saturated: nothing was committed, and the
        // same request with the same key may be retried.
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_) => {
            ProblemResponse::new(ErrorCode::StoreUnavailable, format!("database unavailable: {e}"))
                .retry_after(Duration::from_secs(1))
        }
        e => ProblemResponse::new(ErrorCode::Internal, format!("database error: {e}")),
    }
}

/// Runs inside the claim's transaction: the order row, the claim and the stored
/// response commit together, or none of them does.
async fn create_order_sqlite(
    ctx: IdempotencyContext,
    mut tx: Tx<SqliteTx>,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    simulated_work().await;
    let id: i64 =
        sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id")
            .bind(ctx.scope.account.as_str())
            .bind(&order.sku)
            .bind(order.quantity)
            .fetch_one(&mut **tx)
            .await
            .map_err(internal)?;
    Ok(order.created(id))
}

/// The same handler on PostgreSQL.
async fn create_order_pg(
    ctx: IdempotencyContext,
    mut tx: Tx<PgTx>,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    simulated_work().await;
    let id: i64 =
        sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES ($1, $2, $3) RETURNING id")
            .bind(ctx.scope.account.as_str())
            .bind(&order.sku)
            .bind(order.quantity)
            .fetch_one(&mut **tx)
            .await
            .map_err(internal)?;
    Ok(order.created(id))
}

/// Keys in Redis (lease mode): the order is written in its own SQLite
/// transaction, and the layer stores the response in Redis afterwards.
async fn create_order_redis(
    State(db): State<Db>,
    ctx: IdempotencyContext,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    let Db::Sqlite(store) = db else {
        return Err(ProblemResponse::new(
            ErrorCode::Internal,
            "orders live in SQLite with a Redis key store",
        ));
    };
    simulated_work().await;
    let mut tx = store
        .begin()
        .await
        .map_err(|e| ProblemResponse::new(ErrorCode::StoreUnavailable, e.to_string()))?;
    let id: i64 =
        sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id")
            .bind(ctx.scope.account.as_str())
            .bind(&order.sku)
            .bind(order.quantity)
            .fetch_one(&mut *tx)
            .await
            .map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    Ok(order.created(id))
}

#[derive(Clone)]
enum Db {
    Sqlite(Arc<SqliteStore>),
    Postgres(Arc<PgStore>),
}

async fn count_orders(State(db): State<Db>, parts: Parts) -> Result<Response, ProblemResponse> {
    let account = accounts().resolve(&parts)?;
    let count: i64 = match &db {
        Db::Sqlite(s) => {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE account = ?1")
                .bind(account.as_str())
                .fetch_one(s.pool())
                .await
        }
        Db::Postgres(s) => {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE account = $1")
                .bind(account.as_str())
                .fetch_one(s.pool())
                .await
        }
    }
    .map_err(internal)?;
    Ok(axum::Json(serde_json::json!({ "count": count })).into_response())
}

fn configure(builder: IdempotencyLayerBuilder, lease: Duration) -> anyhow::Result<IdempotencyLayer> {
    Ok(builder
        .policy(Policy::new().with_lease(lease))
        .max_request_body(64 * 1024)
        .build()?)
}

/// The account of a bearer token: an HMAC of it under `ACCOUNT_SECRET` (the
/// same on every instance), so no token is kept in the key table or in
/// `orders.account`. Without the variable a fixed development secret is used.
fn accounts() -> BearerTokenAccount {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let secret = SECRET.get_or_init(|| {
        std::env::var("ACCOUNT_SECRET").unwrap_or_else(|_| {
            tracing::warn!("ACCOUNT_SECRET is not set: accounts are derived with a development secret");
            "idemkit quickstart development secret".to_owned()
        })
    });
    BearerTokenAccount::new(secret.as_bytes())
}

/// Opens the database and returns the state and the idempotent `POST /orders` route.
async fn open(lease: Duration) -> anyhow::Result<(Db, MethodRouter<Db>, String)> {
    let url = std::env::var("DATABASE_URL").ok();
    Ok(match url.as_deref() {
        Some(url) if StoreKind::of(url) == StoreKind::Postgres => {
            // Keys in Redis need the orders in the SQLite file; on PostgreSQL the
            // keys live in the orders' own transactions. Running with PostgreSQL
            // keys while the operator asked for Redis would be a silent surprise.
            if let Some(keystore) = std::env::var("IDEMKIT_KEYSTORE").ok().filter(|k| !k.is_empty()) {
                anyhow::bail!(
                    "IDEMKIT_KEYSTORE={keystore} cannot be combined with a PostgreSQL DATABASE_URL: \
                     with PostgreSQL the keys are kept in PostgreSQL, in each order's transaction; \
                     unset IDEMKIT_KEYSTORE, or unset DATABASE_URL to keep orders in SQLite and keys in Redis"
                );
            }
            let schema = std::env::var("IDEMKIT_PG_SCHEMA").unwrap_or_else(|_| "idemkit".into());
            let options = OpenOptions::new().with_pg_schema(schema.clone());
            let OpenedStore::Postgres(store) = open_store(url, &options)
                .await
                .context("connecting to PostgreSQL")?
            else {
                unreachable!("a postgres:// URL opens PostgreSQL");
            };
            // Several instances may start at once: serialise the DDL.
            let mut tx = store.pool().begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(7345243912)")
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL, \
                 sku TEXT NOT NULL, quantity BIGINT NOT NULL)",
            )
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            let layer = configure(IdempotencyLayer::single_step(store.clone(), accounts()), lease)?;
            (
                Db::Postgres(store),
                post(create_order_pg).layer(layer),
                format!("PostgreSQL schema {schema}"),
            )
        }
        Some(url) if url.starts_with("sqlite:") => sqlite(url, lease).await?,
        Some(url) => {
            anyhow::bail!("DATABASE_URL `{url}` is not supported: use sqlite://PATH or postgres://…")
        }
        None => {
            let path = std::env::var("IDEMKIT_DB").unwrap_or_else(|_| "idemkit-quickstart.db".into());
            sqlite(&path, lease).await?
        }
    })
}

async fn sqlite(location: &str, lease: Duration) -> anyhow::Result<(Db, MethodRouter<Db>, String)> {
    let OpenedStore::Sqlite(store) = open_store(location, &OpenOptions::new())
        .await
        .with_context(|| format!("opening {location}"))?
    else {
        unreachable!("DATABASE_URL sqlite:… or IDEMKIT_DB opens SQLite");
    };
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, \
         sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    match std::env::var("IDEMKIT_KEYSTORE").ok().filter(|k| !k.is_empty()) {
        Some(url) if StoreKind::of(&url) == StoreKind::Redis => {
            let mut options = OpenOptions::new();
            if let Ok(prefix) = std::env::var("IDEMKIT_REDIS_PREFIX") {
                options = options.with_redis_prefix(prefix);
            }
            let keys = open_store(&url, &options)
                .await
                .context("connecting to Redis")?
                .key_store();
            let layer = configure(IdempotencyLayer::lease(keys, accounts()), lease)?;
            let described = format!("Redis {url} (keys) and SQLite {location} (orders)");
            Ok((
                Db::Sqlite(store),
                post(create_order_redis).layer(layer),
                described,
            ))
        }
        Some(other) => anyhow::bail!("IDEMKIT_KEYSTORE `{other}` is not supported: use redis://…"),
        None => {
            let layer = configure(IdempotencyLayer::single_step(store.clone(), accounts()), lease)?;
            Ok((
                Db::Sqlite(store),
                post(create_order_sqlite).layer(layer),
                format!("SQLite {location}"),
            ))
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();

    let port: u16 = std::env::var("PORT")
        .ok()
        .map(|p| p.parse())
        .transpose()
        .context("PORT")?
        .unwrap_or(3000);
    let lease_ms: u64 = std::env::var("IDEMKIT_LEASE_MS")
        .ok()
        .map(|v| v.parse())
        .transpose()
        .context("IDEMKIT_LEASE_MS")?
        .unwrap_or(30_000);
    let delay_ms: u64 = std::env::var("IDEMKIT_HANDLER_DELAY_MS")
        .ok()
        .map(|v| v.parse())
        .transpose()
        .context("IDEMKIT_HANDLER_DELAY_MS")?
        .unwrap_or(0);
    HANDLER_DELAY.get_or_init(|| Duration::from_millis(delay_ms));
    let (db, create, described) = open(Duration::from_millis(lease_ms)).await?;
    let app = Router::new()
        .route("/orders", create)
        .route("/orders/count", get(count_orders))
        .fallback(idemkit::layer::not_found)
        .method_not_allowed_fallback(idemkit::layer::method_not_allowed)
        .with_state(db);

    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!(
        "quickstart listening on http://{} (keys and orders in {described})",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
