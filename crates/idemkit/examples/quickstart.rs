//! The quickstart: an orders API whose `POST /orders` is idempotent.
//!
//! ```text
//! cargo run --example quickstart            # serves on 127.0.0.1:3000
//! PORT=4000 IDEMKIT_DB=/tmp/q.db cargo run --example quickstart
//! DATABASE_URL=sqlite:///tmp/q.db cargo run --example quickstart
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

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::request::Parts;
use http::{StatusCode, header};
use idemkit::core::ErrorCode;
use idemkit::sqlite::{SqliteStore, SqliteTx};
use idemkit::tower::{
    AccountResolver, BearerTokenAccount, IdempotencyContext, IdempotencyLayer, Json, ProblemResponse, Tx,
};
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

/// Runs inside the claim's transaction: the order row, the claim and the stored
/// response commit together, or none of them does.
async fn create_order(
    ctx: IdempotencyContext,
    mut tx: Tx<SqliteTx>,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    let account = ctx.scope.account.as_str();
    if order.sku.trim().is_empty() || order.sku.len() > 100 {
        return Err(ProblemResponse::new(
            ErrorCode::ValidationFailed,
            "`sku` must be 1 to 100 characters",
        ));
    }
    if order.quantity < 1 {
        return Err(ProblemResponse::new(
            ErrorCode::ValidationFailed,
            "`quantity` must be an integer of at least 1",
        ));
    }
    let id: i64 =
        sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id")
            .bind(account)
            .bind(&order.sku)
            .bind(order.quantity)
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| {
                ProblemResponse::new(ErrorCode::Internal, format!("could not insert the order: {e}"))
            })?;
    let body = Order {
        id,
        sku: order.sku,
        quantity: order.quantity,
    };
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        axum::Json(body),
    )
        .into_response())
}

async fn count_orders(
    State(store): State<Arc<SqliteStore>>,
    parts: Parts,
) -> Result<Response, ProblemResponse> {
    let account = BearerTokenAccount.resolve(&parts)?;
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE account = ?1")
        .bind(account.as_str())
        .fetch_one(store.pool())
        .await
        .map_err(|e| ProblemResponse::new(ErrorCode::Internal, e.to_string()))?;
    Ok(axum::Json(serde_json::json!({ "count": count })).into_response())
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
    let location = match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("sqlite:") => url,
        Ok(url) => anyhow::bail!("DATABASE_URL `{url}` is not supported here: use sqlite://PATH"),
        Err(_) => std::env::var("IDEMKIT_DB").unwrap_or_else(|_| "idemkit-quickstart.db".into()),
    };
    let store = Arc::new(
        SqliteStore::open(&location)
            .await
            .with_context(|| format!("opening {location}"))?,
    );
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, \
         sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    let idempotency = IdempotencyLayer::transactional(store.clone())
        .resolver(BearerTokenAccount)
        .max_request_body(64 * 1024)
        .build()?;
    let app = Router::new()
        .route("/orders", post(create_order).layer(idempotency))
        .route("/orders/count", get(count_orders))
        .fallback(idemkit::tower::not_found)
        .method_not_allowed_fallback(idemkit::tower::method_not_allowed)
        .with_state(store);

    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!(
        "quickstart listening on http://{} (keys in {location})",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
