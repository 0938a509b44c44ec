//! The handler: the quickstart's order write, bare and under each setup.

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewOrder {
    sku: String,
    quantity: i64,
}

#[derive(Serialize)]
pub(crate) struct Order {
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

pub(crate) fn internal(e: sqlx::Error) -> ProblemResponse {
    ProblemResponse::new(ErrorCode::Internal, format!("database error: {e}"))
}

pub(crate) fn unavailable(e: impl std::fmt::Display) -> ProblemResponse {
    ProblemResponse::new(ErrorCode::StoreUnavailable, e.to_string())
}

pub(crate) const SQLITE_INSERT: &str =
    "INSERT INTO orders (account, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id";
pub(crate) const PG_INSERT: &str =
    "INSERT INTO orders (account, sku, quantity) VALUES ($1, $2, $3) RETURNING id";

/// The account of the bare handlers: the bearer token, as `BearerTokenAccount`
/// resolves it for the idemkit layer (no clone of the request parts).
pub(crate) struct Bearer(String);

impl<S: Send + Sync> FromRequestParts<S> for Bearer {
    type Rejection = ProblemResponse;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        idemkit_tower::bearer_token(parts)
            .map(|t| Self(t.to_owned()))
            .ok_or_else(|| {
                ProblemResponse::new(ErrorCode::Unauthorized, "send `Authorization: Bearer <token>`")
            })
    }
}

/// (2) The quickstart's `create_order_sqlite`: runs inside the claim's transaction.
pub(crate) async fn create_order_sqlite(
    ctx: IdempotencyContext,
    mut tx: Tx<SqliteTx>,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    let id: i64 = sqlx::query_scalar(SQLITE_INSERT)
        .bind(ctx.scope.account.as_str())
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut **tx)
        .await
        .map_err(internal)?;
    Ok(order.created(id))
}

/// (1) The same insert without idempotency: its own transaction, through the
/// same store (and so the same writer queue) the single-step layer uses.
pub(crate) async fn create_order_sqlite_bare(
    State(store): State<Arc<SqliteStore>>,
    Bearer(account): Bearer,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    let mut tx = store.begin().await.map_err(unavailable)?;
    let id: i64 = sqlx::query_scalar(SQLITE_INSERT)
        .bind(&account)
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut *tx)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    Ok(order.created(id))
}

/// (4) The quickstart's `create_order_pg`.
pub(crate) async fn create_order_pg(
    ctx: IdempotencyContext,
    mut tx: Tx<PgTx>,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    let id: i64 = sqlx::query_scalar(PG_INSERT)
        .bind(ctx.scope.account.as_str())
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut **tx)
        .await
        .map_err(internal)?;
    Ok(order.created(id))
}

/// (3) The same insert without idempotency: its own transaction on the same pool.
pub(crate) async fn create_order_pg_bare(
    State(store): State<Arc<PgStore>>,
    Bearer(account): Bearer,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    let mut tx = store.pool().begin().await.map_err(unavailable)?;
    let id: i64 = sqlx::query_scalar(PG_INSERT)
        .bind(&account)
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut *tx)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    Ok(order.created(id))
}

/// (5)–(8) The in-memory order write: no database, the id comes from a counter
/// (which also counts how often the handler ran).
pub(crate) async fn create_order_memory(
    State(ids): State<Arc<AtomicU64>>,
    Json(order): Json<NewOrder>,
) -> Result<Response, ProblemResponse> {
    order.validate()?;
    let id = ids.fetch_add(1, Ordering::Relaxed) + 1;
    Ok(order.created(id as i64))
}
