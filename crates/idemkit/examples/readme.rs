//! An orders API whose `POST /orders` is idempotent (the README's example).

use std::sync::Arc;

use axum::{Router, routing::post};
use http::StatusCode;
use idemkit::ErrorCode;
use idemkit::sqlite::{SqliteStore, SqliteTx};
use idemkit::tower::{BearerTokenAccount, IdempotencyLayer, Json, ProblemResponse, Tx};

#[derive(serde::Deserialize)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

// Runs at most once per (account, key): the claim, this insert and the stored
// response commit in one transaction. Retries get the stored 201 back. A failed
// insert answers a 500 problem document: nothing is stored and the key is free
// for the retry.
async fn create(mut tx: Tx<SqliteTx>, Json(o): Json<NewOrder>) -> Result<StatusCode, ProblemResponse> {
    sqlx::query("INSERT INTO orders (sku, quantity) VALUES (?1, ?2)")
        .bind(o.sku)
        .bind(o.quantity)
        .execute(&mut **tx)
        .await
        .map_err(|e| ProblemResponse::new(ErrorCode::Internal, format!("storing the order: {e}")))?;
    Ok(StatusCode::CREATED)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(SqliteStore::connect("app.db").await?);
    // The application's own table, in the database that holds the keys.
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders \
         (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    let keys = IdempotencyLayer::transactional(store)
        .resolver(BearerTokenAccount)
        .build()?;
    let app = Router::new().route("/orders", post(create).layer(keys));
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    axum::serve(tokio::net::TcpListener::bind(addr).await?, app).await?;
    Ok(())
}
