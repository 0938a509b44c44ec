//! The courier simulator (`idemkit courier`): the external, non-rollbackable
//! system the labels service calls, as a separate HTTP service on its own port
//! with its own database. It honours `Idempotency-Key` itself (it is built with
//! idemkit) and injects faults on request, and `GET /_stats` counts its real
//! external effects, so tests can prove that retries never ship a parcel twice.
//!
//! ```no_run
//! use idemkit_labels::courier::{self, CourierConfig, FaultUpdate, Stats};
//!
//! # async fn demo() -> anyhow::Result<()> {
//! // A courier on 127.0.0.1 with a free port and a fresh temporary SQLite file.
//! let running = courier::start(CourierConfig::default()).await?;
//! let http = reqwest::Client::new();
//! http.post(format!("{}/_faults", running.url()))
//!     .json(&FaultUpdate::fail_next(1, 503))
//!     .send()
//!     .await?;
//! let created = http
//!     .post(format!("{}/shipments", running.url()))
//!     .header("Idempotency-Key", "label-42-courier")
//!     .json(&serde_json::json!({"reference": "label-42", "shipTo": {}, "shipFrom": {}, "parcel": {}}))
//!     .send()
//!     .await?;
//! assert_eq!(created.status(), 503); // the injected failure; a retry succeeds
//! let stats: Stats = running.courier().stats().await?;
//! assert_eq!(stats.shipments, 0);
//! running.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # Routes
//!
//! - `POST /shipments` requires `Idempotency-Key` (missing: `400
//!   idempotency_key_missing` from the layer). Body: any JSON object; the labels
//!   service sends `reference`, `shipTo`, `shipFrom` and `parcel`, which are kept
//!   as sent. Answers `201 {"orderNumber": "ORD-000123", "trackingNumber":
//!   "TRK0000000123", "shipment": 123}`, numbers derived from the sequential
//!   shipment number ([`order_number`], [`tracking_number`]). The same key again
//!   replays that answer (`201`, byte-identical, `Idempotent-Replayed: true`);
//!   the same key with another body is `409 idempotency_key_reused`. A duplicate
//!   arriving while the first call with its key is still running waits for it
//!   (up to [`CourierConfig::in_flight_wait`], default 10 s, then `409
//!   idempotency_request_in_progress`) and gets the same answer. A call runs to
//!   its commit even when its client stops waiting.
//! - `GET /shipments/{n}/events`: `{"shipment": n, "trackingNumber": …, "events":
//!   [{"at": RFC 3339, "status", "description"}, …]}`, oldest first:
//!   `label_created` at creation, `picked_up` 10 s later and `in_transit` 60 s
//!   later, each listed once its time has come (1–3 events). Unknown `n`: `404`.
//! - `POST /_faults` ([`FaultUpdate`]) sets faults and answers the faults now in
//!   force ([`Faults`]); `GET /_faults` shows them. Faults count down per call
//!   of `POST /shipments` and live in memory only.
//! - `GET /_stats` ([`Stats`]): `{"shipments", "calls", "duplicatesSuppressed"}`.
//!
//! # Faults
//!
//! In the order a call meets them:
//!
//! 1. `failNext` (`status`, default 503; 408, 429 or 5xx): the call is answered
//!    at the door with a problem `code: "courier_unavailable"`, `retryable:
//!    true`; the key is not looked at and nothing is created.
//! 2. `rejectNext`: likewise at the door, `422` with `code: "address_rejected"`,
//!    `retryable: false`: permanent, and well-behaved clients do not retry it.
//!    It is not stored under the key.
//! 3. `latencyMs`: spent inside the call, after the key is claimed and before
//!    the commit, on every call while set. Replays do not spend it.
//! 4. `dropResponseAfterCommit`: a successful answer (fresh or replayed) is
//!    committed and then the connection is closed without any response; the
//!    client sees a connection error, the shipment exists, and a retry with the
//!    same key replays it.
//!
//! `{"reset": true}` clears every fault (counters are not reset).
//!
//! # Counters
//!
//! - `shipments`: shipment rows in the database (all ever created there; with
//!   the default temporary database, since this courier started).
//! - `calls`: every `POST /shipments` that reached the service since it started,
//!   duplicates, malformed calls and injected failures included.
//! - `duplicatesSuppressed`: calls answered with a replay of a stored answer
//!   instead of creating a shipment, since it started.
//!
//! # Storage and scope
//!
//! [`CourierConfig::database_url`]: `postgres://…` (keys and shipments in the
//! schema [`CourierConfig::pg_schema`], default `idemkit_courier`, so it can
//! share a database with the labels service without sharing its keys),
//! `sqlite://…` or a plain file path; by default a fresh SQLite file in a new
//! temporary directory, removed when the courier is dropped (a killed process
//! leaves it behind in the system's temporary directory). Give the courier its
//! own database: its keys must not share a table with its callers' keys.
//!
//! The courier has no authentication, so every caller shares one key space: keys
//! are scoped by the fixed account [`COURIER_ACCOUNT`]. That is an explicit
//! single-tenant choice, sound here because the labels service is its only
//! client and derives its courier keys from its own scoped keys. (A fixed
//! account rather than the layer's `.unscoped()`, whose account identifier
//! starts with a NUL byte that PostgreSQL `TEXT` refuses.)
//!
//! # Serving
//!
//! [`Courier::serve`] runs its own accept loop (hyper HTTP/1.1) rather than
//! `axum::serve`: dropping a response after its commit needs control of the
//! connection. The router is therefore not exposed on its own.

mod clock;
mod conn;
mod db;
mod faults;
mod routes;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use faults::{DEFAULT_FAIL_STATUS, FaultUpdate, Faults};

/// The one account all courier keys are scoped by (the courier has no accounts).
pub const COURIER_ACCOUNT: &str = "courier";

/// The PostgreSQL schema the courier uses by default.
pub const DEFAULT_PG_SCHEMA: &str = "idemkit_courier";

/// How the courier is set up. Build with [`CourierConfig::default`] and the
/// `with_*` setters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CourierConfig {
    /// `postgres://…`, `sqlite://…` or a SQLite file path; `None` (default): a
    /// fresh SQLite file in a new temporary directory, removed with the courier.
    pub database_url: Option<String>,
    /// The PostgreSQL schema for keys and shipments (default
    /// [`DEFAULT_PG_SCHEMA`]).
    pub pg_schema: String,
    /// How long a duplicate of a call still in flight waits for it before
    /// answering `409 idempotency_request_in_progress` (default 10 s).
    pub in_flight_wait: Duration,
}

impl Default for CourierConfig {
    fn default() -> Self {
        Self {
            database_url: None,
            pg_schema: DEFAULT_PG_SCHEMA.to_owned(),
            in_flight_wait: Duration::from_secs(10),
        }
    }
}

impl CourierConfig {
    /// Sets the database (see [`CourierConfig::database_url`]).
    pub fn with_database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = Some(url.into());
        self
    }

    /// Sets the PostgreSQL schema.
    pub fn with_pg_schema(mut self, schema: impl Into<String>) -> Self {
        self.pg_schema = schema.into();
        self
    }

    /// Sets how long in-flight duplicates wait.
    pub fn with_in_flight_wait(mut self, wait: Duration) -> Self {
        self.in_flight_wait = wait;
        self
    }
}

/// `GET /_stats`: the courier's real external effects and what it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// Shipment rows created in the courier's database.
    pub shipments: u64,
    /// `POST /shipments` calls that reached the courier since it started.
    pub calls: u64,
    /// Calls answered with a replay instead of a new shipment, since it started.
    pub duplicates_suppressed: u64,
}

/// The `201` answer of `POST /shipments` (and of its replays).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShipmentCreated {
    /// [`order_number`] of the shipment.
    pub order_number: String,
    /// [`tracking_number`] of the shipment.
    pub tracking_number: String,
    /// The sequential shipment number (`n` in `/shipments/{n}/events`).
    pub shipment: i64,
}

impl ShipmentCreated {
    /// The answer for shipment `n`.
    pub fn new(n: i64) -> Self {
        Self {
            order_number: order_number(n),
            tracking_number: tracking_number(n),
            shipment: n,
        }
    }
}

/// `GET /shipments/{n}/events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TrackingEvents {
    /// The shipment number.
    pub shipment: i64,
    /// Its tracking number.
    pub tracking_number: String,
    /// Oldest first.
    pub events: Vec<TrackingEvent>,
}

/// One tracking event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrackingEvent {
    /// When, RFC 3339 in UTC with milliseconds (`2024-05-01T12:00:00.000Z`).
    pub at: String,
    /// `label_created`, `picked_up` or `in_transit`.
    pub status: String,
    /// For humans.
    pub description: String,
}

/// The order number of shipment `n`: `ORD-` and `n` in at least 6 digits.
///
/// ```
/// assert_eq!(idemkit_labels::courier::order_number(123), "ORD-000123");
/// ```
pub fn order_number(n: i64) -> String {
    format!("ORD-{n:06}")
}

/// The tracking number of shipment `n`: `TRK` and `n` in at least 10 digits.
///
/// ```
/// assert_eq!(idemkit_labels::courier::tracking_number(123), "TRK0000000123");
/// ```
pub fn tracking_number(n: i64) -> String {
    format!("TRK{n:010}")
}

struct Inner {
    db: db::Db,
    described: String,
    in_flight_wait: Duration,
    faults: Mutex<Faults>,
    calls: AtomicU64,
    duplicates: AtomicU64,
    /// The last call's `Request-Timeout`; `u64::MAX` when it had none.
    last_request_timeout: AtomicU64,
    /// Last, so the store is dropped before its directory goes.
    _temp: Option<db::TempDir>,
}

/// An opened courier: its database, faults and counters. Cheap to clone (all
/// clones share the state). Serve it with [`Courier::serve`] or
/// [`Courier::spawn`].
#[derive(Clone)]
pub struct Courier {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Courier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Courier")
            .field("database", &self.inner.described)
            .finish_non_exhaustive()
    }
}

impl Courier {
    /// Opens the database (creating the shipments table and the key store's
    /// tables if missing).
    pub async fn open(config: CourierConfig) -> anyhow::Result<Self> {
        let opened = db::open(config.database_url.as_deref(), &config.pg_schema).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                db: opened.db,
                described: opened.described,
                in_flight_wait: config.in_flight_wait,
                faults: Mutex::new(Faults::default()),
                calls: AtomicU64::new(0),
                duplicates: AtomicU64::new(0),
                last_request_timeout: AtomicU64::new(u64::MAX),
                _temp: opened.temp,
            }),
        })
    }

    /// Where shipments and keys live, for humans (e.g. `SQLite courier.db`).
    pub fn database(&self) -> &str {
        &self.inner.described
    }

    /// The counters `GET /_stats` answers.
    pub async fn stats(&self) -> Result<Stats, sqlx::Error> {
        let shipments = self.inner.db.count().await?;
        Ok(Stats {
            shipments: u64::try_from(shipments).unwrap_or(0),
            calls: self.inner.calls.load(Ordering::Relaxed),
            duplicates_suppressed: self.inner.duplicates.load(Ordering::Relaxed),
        })
    }

    /// The `Request-Timeout` (milliseconds its caller still waited) of the last
    /// `POST /shipments` call, if it sent one (`GET /_deadline`): how tests see
    /// that the labels service hands its caller's remaining deadline to the
    /// courier.
    pub fn last_request_timeout(&self) -> Option<Duration> {
        Some(self.inner.last_request_timeout.load(Ordering::Relaxed))
            .filter(|ms| *ms != u64::MAX)
            .map(Duration::from_millis)
    }

    /// The faults in force.
    pub fn faults(&self) -> Faults {
        *self.lock_faults()
    }

    /// Applies a fault update as `POST /_faults` does; returns the faults now in
    /// force, or why the update was refused (then nothing changed).
    pub fn set_faults(&self, update: &FaultUpdate) -> Result<Faults, String> {
        let mut faults = self.lock_faults();
        faults.apply(update)?;
        Ok(*faults)
    }

    pub(crate) fn lock_faults(&self) -> MutexGuard<'_, Faults> {
        self.inner.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) async fn spend_latency(&self) {
        let latency = self.lock_faults().latency();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
    }

    /// Serves on `listener` until the future is dropped.
    pub async fn serve(self, listener: TcpListener) -> anyhow::Result<()> {
        self.serve_with_shutdown(listener, std::future::pending()).await
    }

    /// Serves on `listener` until `shutdown` resolves; then stops accepting,
    /// lets calls in flight finish and returns.
    pub async fn serve_with_shutdown(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let router = routes::router(&self, self.inner.in_flight_wait)?;
        conn::serve(router, listener, shutdown).await;
        Ok(())
    }

    /// Serves on `listener` in a background task; the handle stops it.
    pub fn spawn(self, listener: TcpListener) -> anyhow::Result<RunningCourier> {
        let addr = listener.local_addr()?;
        let router = routes::router(&self, self.inner.in_flight_wait)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(conn::serve(router, listener, async move {
            let _ = stopped.await;
        }));
        Ok(RunningCourier {
            addr,
            courier: self,
            stop: Some(stop),
            task: Some(task),
        })
    }
}

/// A courier serving in a background task ([`Courier::spawn`], [`start`]).
/// Dropping it stops accepting and lets calls in flight finish in the background.
#[derive(Debug)]
pub struct RunningCourier {
    addr: SocketAddr,
    courier: Courier,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl RunningCourier {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, without a trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The courier, for in-process stats and faults.
    pub fn courier(&self) -> &Courier {
        &self.courier
    }

    /// Stops accepting, waits for calls in flight, and returns.
    pub async fn shutdown(mut self) {
        drop(self.stop.take());
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for RunningCourier {
    fn drop(&mut self) {
        drop(self.stop.take());
    }
}

/// Opens a courier and serves it on `listener` until the future is dropped.
pub async fn serve(listener: TcpListener, config: CourierConfig) -> anyhow::Result<()> {
    Courier::open(config).await?.serve(listener).await
}

/// Opens a courier and serves it in the background on `127.0.0.1` with a free
/// port: the one-liner for tests and demos.
pub async fn start(config: CourierConfig) -> anyhow::Result<RunningCourier> {
    let courier = Courier::open(config).await?;
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
    courier.spawn(listener)
}
