//! The crash-recovery harness's server: a multi-step request with a business
//! insert, an external call and a final phase, which the harness kills (SIGKILL)
//! at any phase boundary.
//!
//! `POST /labels` (bearer account, `Idempotency-Key`, any JSON body): phase
//! `insert` writes a label row (with the request's key); external step `courier`
//! asks the courier stub (`COURIER_URL`) for a shipment, sending the derived
//! downstream key; phase `done` records the shipment on the label and stores
//! `201 {"id","shipment"}`.
//!
//! `GET /labels/count` counts every label; `GET /labels/by-key/{key}` lists the
//! labels of one idempotency key (`{"rows": [{"id", "shipment"}]}`, oldest
//! first), so the harness can see what a killed attempt committed.
//!
//! Environment: `PORT`; `DATABASE_URL` (`postgres://…`, with `IDEMKIT_PG_SCHEMA`)
//! or `IDEMKIT_DB` (SQLite file); `COURIER_URL`; `IDEMKIT_LEASE_MS`;
//! `IDEMKIT_CRASH_AT` (a failpoint name such as `idemkit::after_intent`: the process
//! prints `CRASHPOINT <name>` and stops there until killed);
//! `IDEMKIT_COURIER_HONOURS_KEYS=0` (declare the courier as ignoring keys);
//! `IDEMKIT_COMPLETER_MS` (run the completer every N ms);
//! `IDEMKIT_IDEMPOTENCY=off` (the negative control: no layer, no phases, a fresh
//! courier key per call).
//!
//! Built with `--features failpoints`.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::StatusCode;
use idemkit_core::{KeyStore, Policy};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_sqlite::SqliteStore;
use idemkit_tower::{
    BearerTokenAccount, CallError, Completer, Downstream, IdempotencyContext, IdempotencyLayer, PhaseError,
    Phases,
};

#[derive(Clone)]
struct App<S> {
    store: Arc<S>,
    courier: String,
    http: reqwest::Client,
    downstream: Downstream,
}

/// Asks the courier for a shipment. A refused connection certainly did not
/// reach it; anything after the request was sent may have.
async fn call_courier(http: &reqwest::Client, courier: &str, key: &str) -> Result<i64, CallError<String>> {
    let res = http
        .post(format!("{courier}/shipments"))
        .header("idempotency-key", key)
        .send()
        .await
        .map_err(|e| {
            if e.is_connect() {
                CallError::NotExecuted(e.to_string())
            } else {
                CallError::Unknown(e.to_string())
            }
        })?;
    let body: serde_json::Value = res.json().await.map_err(|e| CallError::Unknown(e.to_string()))?;
    body["shipment"]
        .as_i64()
        .ok_or_else(|| CallError::Unknown(format!("bad courier answer {body}")))
}

fn failed(e: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// The harness's handler, once per database (the SQL differs only in placeholders).
macro_rules! create_label {
    ($name:ident, $store:ty, $insert:literal, $update:literal) => {
        async fn $name(
            State(app): State<App<$store>>,
            ctx: IdempotencyContext,
        ) -> Result<Response, PhaseError<(StatusCode, String)>> {
            let account = ctx.scope.account.as_str().to_owned();
            let key = ctx.scope.key.as_str().to_owned();
            let mut phases = Phases::begin(app.store.clone(), &ctx).await?;
            let id: i64 = phases
                .phase("insert", async |tx| {
                    sqlx::query_scalar($insert)
                        .bind(account.clone())
                        .bind(key.clone())
                        .fetch_one(&mut **tx)
                        .await
                        .map_err(failed)
                })
                .await?;
            let shipment: i64 = phases
                .external("courier", app.downstream, async |key| {
                    call_courier(&app.http, &app.courier, key.as_str())
                        .await
                        .map_err(|e| e.map(|m| (StatusCode::BAD_GATEWAY, m)))
                })
                .await?;
            phases
                .finish("done", async |tx| {
                    sqlx::query($update).bind(shipment).bind(id).execute(&mut **tx).await.map_err(failed)?;
                    Ok((StatusCode::CREATED, axum::Json(serde_json::json!({ "id": id, "shipment": shipment })))
                        .into_response())
                })
                .await
        }
    };
}

create_label!(
    create_label_sqlite,
    SqliteStore,
    "INSERT INTO labels (account, idem_key) VALUES (?1, ?2) RETURNING id",
    "UPDATE labels SET shipment = ?1 WHERE id = ?2"
);
create_label!(
    create_label_pg,
    PgStore,
    "INSERT INTO labels (account, idem_key) VALUES ($1, $2) RETURNING id",
    "UPDATE labels SET shipment = $1 WHERE id = $2"
);

/// The negative control: the same work with no idempotency at all.
async fn naive_label(State(app): State<App<SqliteStore>>, headers: http::HeaderMap) -> Response {
    let account = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anon")
        .to_owned();
    let idem_key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let insert = "INSERT INTO labels (account, idem_key) VALUES (?1, ?2) RETURNING id";
    let id: i64 = match sqlx::query_scalar(insert)
        .bind(account)
        .bind(idem_key)
        .fetch_one(app.store.pool())
        .await
    {
        Ok(id) => id,
        Err(e) => return failed(e).into_response(),
    };
    let key = uuid::Uuid::new_v4().to_string();
    let shipment = match call_courier(&app.http, &app.courier, &key).await {
        Ok(s) => s,
        Err(_) => return (StatusCode::BAD_GATEWAY, "courier failed").into_response(),
    };
    fail::fail_point!("naive::after_call");
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({ "id": id, "shipment": shipment })),
    )
        .into_response()
}

/// Where the labels live, for `GET /labels/count`.
#[derive(Clone)]
enum Labels {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

/// `GET /labels/count`: how many labels exist (the harness counts side effects).
async fn count_labels(State(labels): State<Labels>) -> axum::Json<serde_json::Value> {
    const COUNT: &str = "SELECT COUNT(*) FROM labels";
    let n: Result<i64, _> = match labels {
        Labels::Sqlite(p) => sqlx::query_scalar(COUNT).fetch_one(&p).await,
        Labels::Postgres(p) => sqlx::query_scalar(COUNT).fetch_one(&p).await,
    };
    axum::Json(serde_json::json!({ "count": n.unwrap_or(-1) }))
}

/// `GET /labels/by-key/{key}`: the labels written for one idempotency key,
/// oldest first (the harness checks there is exactly one, and which).
async fn labels_of_key(
    State(labels): State<Labels>,
    axum::extract::Path(key): axum::extract::Path<String>,
) -> Response {
    let rows: Result<Vec<(i64, Option<i64>)>, _> = match labels {
        Labels::Sqlite(p) => {
            sqlx::query_as("SELECT id, shipment FROM labels WHERE idem_key = ?1 ORDER BY id")
                .bind(key)
                .fetch_all(&p)
                .await
        }
        Labels::Postgres(p) => {
            sqlx::query_as("SELECT id, shipment FROM labels WHERE idem_key = $1 ORDER BY id")
                .bind(key)
                .fetch_all(&p)
                .await
        }
    };
    match rows {
        Ok(rows) => axum::Json(serde_json::json!({
            "rows": rows
                .into_iter()
                .map(|(id, shipment)| serde_json::json!({ "id": id, "shipment": shipment }))
                .collect::<Vec<_>>()
        }))
        .into_response(),
        Err(e) => failed(e).into_response(),
    }
}

fn env_ms(name: &str) -> Option<Duration> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
}

fn install_crash_point() {
    let Ok(name) = std::env::var("IDEMKIT_CRASH_AT") else {
        return;
    };
    let announced = name.clone();
    fail::cfg_callback(name, move || {
        println!("CRASHPOINT {announced}");
        let _ = std::io::stdout().flush();
        // Stop here until the harness kills the process.
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    })
    .expect("failpoint callback");
}

fn layer(store: Arc<impl KeyStore>, lease: Duration) -> IdempotencyLayer {
    IdempotencyLayer::lease(store, BearerTokenAccount::new("test-secret"))
        .policy(Policy::new().with_lease(lease))
        .build()
        .expect("valid layer")
}

#[tokio::main]
async fn main() {
    install_crash_point();
    let port: u16 = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3100);
    let courier = std::env::var("COURIER_URL").expect("COURIER_URL");
    let lease = env_ms("IDEMKIT_LEASE_MS").unwrap_or(Duration::from_millis(300));
    let downstream = match std::env::var("IDEMKIT_COURIER_HONOURS_KEYS").as_deref() {
        Ok("0") => Downstream::IgnoresKeys,
        _ => Downstream::HonoursKeys,
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let naive = std::env::var("IDEMKIT_IDEMPOTENCY").as_deref() == Ok("off");

    let (router, keys, labels): (Router, Arc<dyn KeyStore>, Labels) = match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres") => {
            let schema = std::env::var("IDEMKIT_PG_SCHEMA").unwrap_or_else(|_| "crash".into());
            let store = Arc::new(
                PgStore::connect_with(&url, PgConfig::default().with_schema(schema))
                    .await
                    .unwrap(),
            );
            sqlx::query("CREATE TABLE IF NOT EXISTS labels (id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL, idem_key TEXT NOT NULL, shipment BIGINT)")
                .execute(store.pool())
                .await
                .unwrap();
            let app = App {
                store: store.clone(),
                courier,
                http,
                downstream,
            };
            let router = Router::new()
                .route(
                    "/labels",
                    post(create_label_pg).layer(layer(store.clone(), lease)),
                )
                .with_state(app);
            let labels = Labels::Postgres(store.pool().clone());
            (router, store, labels)
        }
        _ => {
            let path = std::env::var("IDEMKIT_DB").unwrap_or_else(|_| "crash.db".into());
            let store = Arc::new(SqliteStore::connect(&path).await.unwrap());
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS labels (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, idem_key TEXT NOT NULL, shipment INTEGER)",
            )
            .execute(store.pool())
            .await
            .unwrap();
            let app = App {
                store: store.clone(),
                courier,
                http,
                downstream,
            };
            let router = if naive {
                Router::new().route("/labels", post(naive_label)).with_state(app)
            } else {
                Router::new()
                    .route(
                        "/labels",
                        post(create_label_sqlite).layer(layer(store.clone(), lease)),
                    )
                    .with_state(app)
            };
            let labels = Labels::Sqlite(store.pool().clone());
            (router, store, labels)
        }
    };

    let router = router.merge(
        Router::new()
            .route("/labels/count", axum::routing::get(count_labels))
            .route("/labels/by-key/{key}", axum::routing::get(labels_of_key))
            .with_state(labels),
    );
    if let Some(every) = env_ms("IDEMKIT_COMPLETER_MS") {
        Completer::new(keys, router.clone())
            .min_age(Duration::ZERO)
            .spawn(every);
    }

    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    println!("READY {}", listener.local_addr().unwrap());
    let _ = std::io::stdout().flush();
    axum::serve(listener, router).await.unwrap();
}
