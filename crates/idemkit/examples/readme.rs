//! An orders API whose `POST /orders` is idempotent (the README's example).

use axum::{Router, routing::post};
use http::StatusCode;
use idemkit::prelude::*;

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
    let store = SqliteStore::connect("app.db").await?;
    // The application's own table, in the database that holds the keys.
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders \
         (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    // Keys are scoped per account: here a keyed hash of the bearer token (the
    // token is never stored). Every instance needs the same secret.
    let secret = std::env::var("ACCOUNT_SECRET").unwrap_or_else(|_| "dev only: set ACCOUNT_SECRET".into());
    let keys = IdempotencyLayer::single_step(store, BearerTokenAccount::new(secret)).build()?;
    let app = Router::new().route("/orders", post(create).layer(keys));
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    axum::serve(tokio::net::TcpListener::bind(addr).await?, app).await?;
    Ok(())
}
