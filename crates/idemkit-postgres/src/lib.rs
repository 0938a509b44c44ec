//! # idemkit-postgres
//!
//! A [`KeyStore`] on PostgreSQL for services that run many instances on one
//! database. Both claim modes of the contract:
//!
//! - **single-step** ([`TransactionalStore`]): the claim is an
//!   `INSERT … ON CONFLICT DO NOTHING` at the start of the handler's own
//!   transaction. A concurrent duplicate's INSERT blocks on the unique index
//!   until the winner commits, then reads the completed row and replays it; with
//!   in-flight = reject, a short `lock_timeout` turns that wait into SQLSTATE
//!   55P03 and a quick `409`, so no pool connection is held waiting.
//! - **lease** ([`KeyStore::claim`]): the claim commits on its own as
//!   `in_flight` with a lease and a fencing token; every later write is
//!   `… WHERE fencing_token = $mine`.
//!
//! Waiters for an in-flight key are woken by `LISTEN/NOTIFY` (a trigger notifies
//! at commit), not by polling. Deadlocks and serialization failures are retried
//! inside the store a bounded number of times; a lost connection surfaces as
//! [`StoreError::Unavailable`] (a retryable `503`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemkit_core::StoreError> {
//! use idemkit_postgres::{PgConfig, PgStore};
//! let store = PgStore::connect("postgres://app@127.0.0.1/app", PgConfig::default()).await?;
//! # let _ = store; Ok(()) }
//! ```

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::ReviewRow;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Clock, Decision, FORCE_RELEASED, FencingToken, KeyStore, Lease, ListFilter,
    MOVED_TO_REVIEW, Millis, PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, RecordHead, RecordRow,
    Resolution, ReviewEntry, Scope, StoreError, StoreResult, StoredHeader, StoredResponse, SystemClock,
    TransactionalStore, TxClaim,
};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row};
use tokio::sync::broadcast;

/// Embedded migrations, run in the store's schema.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The notification channel waiters listen on.
pub const CHANNEL: &str = "idemkit_changes";

/// Wraps a fenced `UPDATE` so that a changed row somebody waits for (its
/// `has_waiters` is set) wakes this schema's waiters in the same round trip; the
/// statement answers how many rows it changed.
fn notifying(update: &str) -> String {
    format!(
        "WITH u AS ({update} RETURNING account, idem_key, has_waiters) \
         SELECT count(*) FROM (SELECT CASE WHEN has_waiters THEN \
         pg_notify('{CHANNEL}', json_build_array(current_schema(), account, idem_key)::text) END FROM u) AS n"
    )
}

/// The store's clock in SQL: the database's `clock_timestamp()` in Unix
/// milliseconds, unless a test clock is bound at `$n` (see [`PgStore::with_test_clock`]).
/// Every lease is judged by it, so an instance whose own clock is skewed can
/// never take over a live lease (SPEC §3).
fn now_sql(n: usize) -> String {
    format!("COALESCE(${n}::bigint, (extract(epoch from clock_timestamp()) * 1000)::bigint)")
}

/// A fresh fencing token from the store-wide sequence (see the migration).
const NEXT_TOKEN: &str = "nextval('idemkit_fencing_seq')";

const RECORD_COLUMNS: &str = "account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error";

const SELECT_RECORD: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE account = $1 AND idem_key = $2";

/// The completer's work list: in-flight records whose lease has expired (by the
/// store's clock, test clock at `$1`).
static SELECT_ABANDONED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS} FROM idemkit_keys WHERE state = 'in_flight' AND lease_expires_at <= {} \
         AND created_at <= $2 ORDER BY created_at, account, idem_key LIMIT $3",
        now_sql(1)
    )
});

/// Operator listing: records matching an optional state (`$1`) and account
/// (`$2`), newest claim first.
const SELECT_LIST: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR account = $2) \
     ORDER BY created_at DESC, account, idem_key LIMIT $3";

/// An operator's release of a record nobody holds (parked, or in flight with
/// its lease expired by the store's clock, test clock at `$3`), on a fresh
/// token: the same tombstone as a holder's release, or resumable when progress
/// was recorded (see [`KeyStore::force_release`]).
static FORCE_RELEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, last_error = $4, \
         state = CASE WHEN {clean} THEN 'released' ELSE 'in_flight' END, \
         lease_expires_at = CASE WHEN {clean} THEN 0 ELSE LEAST(lease_expires_at, {now}) END, \
         req_body = CASE WHEN {clean} THEN ''::bytea ELSE req_body END \
         WHERE account = $1 AND idem_key = $2 \
         AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= {now}))",
        clean = "recovery_point IS NULL AND step_outputs = '{}'",
        now = now_sql(3)
    )
});

/// A phase's fenced progress write. A step output is set as a top-level key of
/// the JSON object (`||` replaces a key, it does not merge nested objects); the
/// step name is bound as text and the output as JSON text, so neither is parsed
/// as a path or as SQL.
const ADVANCE: &str = "UPDATE idemkit_keys SET recovery_point = $4, \
     step_outputs = CASE WHEN $5::text IS NULL THEN step_outputs \
     ELSE (step_outputs::jsonb || jsonb_build_object($5::text, $6::jsonb))::text END \
     WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'";

/// One reaper pass in one statement (so one transaction). Records that never
/// completed and were claimed before `$1` (in flight with a lease expired by the
/// store's clock, test clock at `$2`, or parked) are listed in `idemkit_review`
/// once and stay in the key table, parked on a fresh token (last error `$3`), so
/// their key is never claimed again as a new request; completed records finished
/// before `$1` and released ones claimed before it are deleted (tokens come from
/// a sequence, so a deleted key's tokens never repeat). Live leases never match.
/// `completed_at >= created_at`, so the `created_at` bound only lets the index
/// narrow the scan.
static REAP: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH now AS (SELECT {now} AS ms), \
         listed AS (UPDATE idemkit_keys k SET fencing_token = {NEXT_TOKEN}, state = 'parked', \
         lease_expires_at = LEAST(k.lease_expires_at, (SELECT ms FROM now)), last_error = $3 \
         FROM now WHERE k.created_at < $1 \
         AND (k.state = 'parked' OR (k.state = 'in_flight' AND k.lease_expires_at <= now.ms)) \
         AND NOT EXISTS (SELECT 1 FROM idemkit_review r WHERE r.account = k.account \
         AND r.idem_key = k.idem_key AND r.created_at = k.created_at) \
         RETURNING k.account, k.idem_key, k.created_at), \
         reviewed AS (INSERT INTO idemkit_review (account, idem_key, state, created_at, reaped_at, \
         recovery_point, step_outputs, last_error, req_method, req_path, req_headers, req_body) \
         SELECT o.account, o.idem_key, o.state, o.created_at, (SELECT ms FROM now), o.recovery_point, \
         o.step_outputs, o.last_error, o.req_method, o.req_path, o.req_headers, o.req_body \
         FROM idemkit_keys o JOIN listed l ON l.account = o.account AND l.idem_key = o.idem_key \
         ORDER BY o.created_at, o.account, o.idem_key RETURNING 1), \
         deleted AS (DELETE FROM idemkit_keys WHERE created_at < $1 \
         AND ((state = 'completed' AND COALESCE(completed_at, created_at) < $1) OR state = 'released') \
         RETURNING 1) \
         SELECT (SELECT count(*) FROM reviewed), (SELECT count(*) FROM deleted)",
        now = now_sql(2)
    )
});

/// Settings of a [`PgStore`].
#[derive(Debug, Clone)]
pub struct PgConfig {
    /// Schema holding the store's table (created if missing; default `idemkit`).
    /// The pool's `search_path` is `<schema>, public`.
    pub schema: String,
    /// Pool size (default 5: three instances use 15 of PostgreSQL's default 100).
    pub max_connections: u32,
    /// How long a request waits for a pooled connection before a retryable 503
    /// (default 5 s).
    pub acquire_timeout: Duration,
    /// `statement_timeout` of every connection (default 10 s).
    pub statement_timeout: Duration,
    /// With in-flight = reject, how long a single-step claim waits on a
    /// concurrent holder's uncommitted claim before answering 409 (default 100 ms).
    pub reject_lock_timeout: Duration,
    /// Attempts for an operation that hits a deadlock or serialization failure
    /// (default 3).
    pub max_attempts: u32,
}

impl Default for PgConfig {
    fn default() -> Self {
        Self {
            schema: "idemkit".into(),
            max_connections: 5,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(10),
            reject_lock_timeout: Duration::from_millis(100),
            max_attempts: 3,
        }
    }
}

/// A [`KeyStore`] on PostgreSQL.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// The application's clock: only [`KeyStore::now`] (coarse cutoffs for the
    /// completer and the reaper) reads it.
    clock: Arc<dyn Clock>,
    /// Replaces the database's clock in every statement (tests only).
    test_clock: Option<Arc<dyn Clock>>,
    config: Arc<PgConfig>,
    changes: broadcast::Sender<(String, String)>,
    _listener: Arc<AbortOnDrop>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A transaction on the store's database, handed to single-step handlers. It
/// dereferences to the connection, so `&mut **tx` through the layer's `Tx`
/// extractor is an sqlx executor. Dropping it rolls back.
pub struct PgTx {
    tx: sqlx::Transaction<'static, Postgres>,
    /// Holds an uncommitted single-step claim (nobody can be waiting on it).
    single_step: bool,
}

impl PgTx {
    /// Commits the transaction.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }
}

impl Deref for PgTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl std::fmt::Debug for PgTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgTx { .. }")
    }
}

/// Refuses a schema name that is not a plain identifier: it is formatted into SQL.
fn check_schema(schema: &str) -> StoreResult<()> {
    if valid_schema(schema) {
        Ok(())
    } else {
        Err(StoreError::Backend(
            format!("schema `{schema}` must match [a-z_][a-z0-9_]{{0,62}}").into(),
        ))
    }
}

fn valid_schema(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.len() <= 63
}

impl PgStore {
    /// Connects, creates the schema if needed and runs the migrations.
    pub async fn connect(url: &str, config: PgConfig) -> StoreResult<Self> {
        let pool = Self::pool_for(url, &config).await?;
        Self::from_pool(pool, config).await
    }

    /// Connects to a store that already exists, with no DDL and no migrations:
    /// for read-only tools (`idemkit keys list`) pointed at a database they must
    /// never change, and for roles without `CREATE`. A schema without the key
    /// table, or with migrations still to run, is an error naming the problem.
    pub async fn connect_existing(url: &str, config: PgConfig) -> StoreResult<Self> {
        let pool = Self::pool_for(url, &config).await?;
        let applied: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = $1 AND table_name IN ('idemkit_keys', '_sqlx_migrations')",
        )
        .bind(&config.schema)
        .fetch_one(&pool)
        .await
        .map_err(map_err)?;
        if applied < 2 {
            return Err(StoreError::Backend(
                format!("schema `{}` holds no idemkit key store", config.schema).into(),
            ));
        }
        let done: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
            .fetch_all(&pool)
            .await
            .map_err(map_err)?;
        if let Some(missing) = MIGRATOR.iter().find(|m| !done.contains(&m.version)) {
            return Err(StoreError::Backend(
                format!(
                    "the key store in schema `{}` needs migration {} ({}); open it once with `PgStore::connect`",
                    config.schema, missing.version, missing.description
                )
                .into(),
            ));
        }
        Self::assemble(pool, config).await
    }

    async fn pool_for(url: &str, config: &PgConfig) -> StoreResult<PgPool> {
        check_schema(&config.schema)?;
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Backend(Box::new(e)))?
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
            .connect_with(options)
            .await
            .map_err(map_err)
    }

    /// Uses an existing pool whose connections already have `search_path` set
    /// to `<schema>, …` (as [`PgStore::connect`] does).
    pub async fn from_pool(pool: PgPool, config: PgConfig) -> StoreResult<Self> {
        check_schema(&config.schema)?;
        {
            // Concurrent `CREATE SCHEMA IF NOT EXISTS` can race in PostgreSQL;
            // serialise it across instances with an advisory lock.
            let mut tx = pool.begin().await.map_err(map_err)?;
            sqlx::query("SELECT pg_advisory_xact_lock(7345243911)")
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
            sqlx::query(AssertSqlSafe(format!(
                "CREATE SCHEMA IF NOT EXISTS {}",
                config.schema
            )))
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
            config: Arc::new(config),
            changes,
            _listener: Arc::new(listener),
        })
    }

    /// Replaces the application clock, which only [`KeyStore::now`] reads (the
    /// completer's and the reaper's coarse cutoffs). Leases, windows and every
    /// stored time are judged by the database's clock whatever this clock says,
    /// so instances whose clocks disagree still agree on who holds a key.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Replaces the database's clock, for every decision of this handle, with
    /// `clock` (and the application clock too). For tests that move time by
    /// hand; never in production, where instances must share one clock.
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock.clone();
        self.test_clock = Some(clock);
        self
    }

    /// The test clock's time, bound where SQL reads the store's clock.
    fn test_now(&self) -> Option<i64> {
        self.test_clock.as_ref().map(|c| c.now().0)
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The settings in force.
    pub fn config(&self) -> &PgConfig {
        &self.config
    }

    /// Runs `op`, retrying deadlocks and serialization failures a bounded number
    /// of times with a short jittered pause.
    async fn retrying<T, F, Fut>(&self, mut op: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Retry>>,
    {
        let mut attempt = 1;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(Retry::Transient(e)) if attempt < self.config.max_attempts => {
                    tracing::debug!(error = %e, attempt, "idemkit-postgres: retrying after a transient conflict");
                    let pause = 5u64 << attempt;
                    tokio::time::sleep(Duration::from_millis(
                        pause / 2 + pause * u64::from(attempt % 2) / 2,
                    ))
                    .await;
                    attempt += 1;
                }
                Err(Retry::Transient(e)) => return Err(StoreError::Unavailable(Box::new(e))),
                Err(Retry::Fatal(e)) => return Err(e),
            }
        }
    }

    async fn read_decision(&self, req: &ClaimRequest) -> StoreResult<(Option<Record>, Decision)> {
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        let (now, existing) = self
            .fetch_with_now(&mut conn, &req.scope, false)
            .await
            .map_err(Retry::into_store)?;
        let decision = req.decide(existing.as_ref().map(RecordHead::from).as_ref(), now);
        Ok((existing, decision))
    }

    /// Reads the record and the store's clock in one statement; with `lock`, the
    /// row (which must exist) is locked `FOR UPDATE`.
    async fn fetch_with_now(
        &self,
        conn: &mut PgConnection,
        scope: &Scope,
        lock: bool,
    ) -> Result<(Millis, Option<Record>), Retry> {
        static PLAIN: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {}, k.* FROM (SELECT 1) AS one LEFT JOIN ({SELECT_RECORD}) AS k ON true",
                now_sql(3)
            )
        });
        static LOCKED: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {}, {RECORD_COLUMNS} FROM idemkit_keys \
                WHERE account = $1 AND idem_key = $2 FOR UPDATE",
                now_sql(3)
            )
        });
        let sql = if lock { &*LOCKED } else { &*PLAIN };
        let row = sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .bind(self.test_now())
            .fetch_optional(&mut *conn)
            .await
            .map_err(Retry::from)?;
        let Some(row) = row else {
            return Ok((self.clock.now(), None));
        };
        let now = Millis(row.try_get(0).map_err(corrupt)?);
        let existing = if row.try_get::<Option<String>, _>(1).map_err(corrupt)?.is_some() {
            Some(decode_at(&row, 1)?)
        } else {
            None
        };
        Ok((now, existing))
    }

    /// Claims inside an open transaction (whose `lock_timeout` bounds the wait on
    /// a concurrent uncommitted claim).
    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<Result<Lease, ClaimOutcome>, Retry> {
        static INSERT: LazyLock<String> = LazyLock::new(|| {
            // The `set_config` runs only when the row was inserted: it lifts the
            // claim's short lock_timeout for the handler's own statements, at no
            // extra round trip.
            format!(
                "WITH now AS (SELECT {} AS ms), \
                 ins AS (INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, \
                 lease_expires_at, fencing_token, req_method, req_path, req_headers, req_body) \
                 SELECT $1, $2, $3, 'in_flight', ms, ms + $5, {NEXT_TOKEN}, $6, $7, $8, $9 FROM now \
                 ON CONFLICT (account, idem_key) DO NOTHING RETURNING fencing_token, lease_expires_at) \
                 SELECT fencing_token, lease_expires_at, set_config('lock_timeout', '0', true) FROM ins",
                now_sql(4)
            )
        });
        if req.resume.is_none() {
            let headers = StoredHeader::encode_list(&req.request.headers)?;
            let inserted = sqlx::query(AssertSqlSafe(INSERT.as_str()))
                .bind(req.scope.account.as_str())
                .bind(req.scope.key.as_str())
                .bind(&req.fingerprint.as_bytes()[..])
                .bind(self.test_now())
                .bind(lease_ms(req.lease))
                .bind(&req.request.method)
                .bind(&req.request.path)
                .bind(&headers)
                .bind(&req.request.body)
                .fetch_optional(&mut *conn)
                .await
                .map_err(Retry::from)?;
            if let Some(row) = inserted {
                return Ok(Ok(Lease {
                    token: FencingToken(row.try_get(0).map_err(corrupt)?),
                    expires_at: Millis(row.try_get(1).map_err(corrupt)?),
                    resumed_from: None,
                }));
            }
        }
        // The row exists (committed, possibly just now by the holder we waited for).
        let (now, existing) = self.fetch_with_now(&mut *conn, &req.scope, true).await?;
        let Some(existing) = existing else {
            // A resume of a record that is gone.
            return Ok(Err(ClaimOutcome::Stale));
        };
        let takeover = match Resolution::of(&existing, req, now)? {
            Resolution::Move { takeover } => takeover,
            Resolution::Settled(outcome) => return Ok(Err(outcome)),
        };
        // Row locked FOR UPDATE above: this compare-and-swap cannot miss.
        match self
            .move_claim(&mut *conn, req, &existing, now, takeover, true)
            .await?
        {
            Some(lease) => Ok(Ok(lease)),
            None => Err(Retry::Fatal(StoreError::Corrupt("locked row changed".into()))),
        }
    }

    /// Begins a transaction whose `lock_timeout` bounds the wait on a concurrent
    /// claim: the configured reject timeout, or the request's own wait.
    async fn begin_claim(&self, lock_wait: Duration) -> Result<sqlx::Transaction<'static, Postgres>, Retry> {
        let ms = if lock_wait.is_zero() {
            self.config.reject_lock_timeout
        } else {
            lock_wait
        }
        .as_millis()
        .max(1);
        // One round trip: the simple-query protocol runs both statements.
        let begin = AssertSqlSafe(format!("BEGIN; SET LOCAL lock_timeout = {ms}"));
        self.pool.begin_with(begin).await.map_err(Retry::from)
    }

    /// The lease-mode claim: one autocommitted statement inserts the in-flight
    /// row or returns the existing one (with the store's clock), so a claim is
    /// one round trip and one commit (a request costs phases + 1 commits).
    /// Takeover and window reuse add a compare-and-swap on the record as read.
    async fn claim_autocommit(&self, req: &ClaimRequest) -> Result<ClaimOutcome, Retry> {
        static CLAIM: LazyLock<String> = LazyLock::new(|| {
            format!(
                "WITH now AS (SELECT {} AS ms), \
                 ins AS (INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, \
                 lease_expires_at, fencing_token, req_method, req_path, req_headers, req_body) \
                 SELECT $1, $2, $3, 'in_flight', ms, ms + $5, {NEXT_TOKEN}, $6, $7, $8, $9 FROM now \
                 WHERE NOT $10 \
                 ON CONFLICT (account, idem_key) DO NOTHING RETURNING fencing_token, lease_expires_at) \
                 SELECT (SELECT fencing_token FROM ins), (SELECT lease_expires_at FROM ins), \
                 (SELECT ms FROM now), k.* FROM (SELECT 1) AS one \
                 LEFT JOIN ({SELECT_RECORD}) AS k ON NOT EXISTS (SELECT 1 FROM ins)",
                now_sql(4)
            )
        });
        let headers = StoredHeader::encode_list(&req.request.headers)?;
        let row = sqlx::query(AssertSqlSafe(CLAIM.as_str()))
            .bind(req.scope.account.as_str())
            .bind(req.scope.key.as_str())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(self.test_now())
            .bind(lease_ms(req.lease))
            .bind(&req.request.method)
            .bind(&req.request.path)
            .bind(&headers)
            .bind(&req.request.body)
            // A resume never inserts: a record that is gone is stale.
            .bind(req.resume.is_some())
            .fetch_one(&self.pool)
            .await
            .map_err(Retry::from)?;
        if let Some(token) = row.try_get::<Option<i64>, _>(0).map_err(corrupt)? {
            return Ok(ClaimOutcome::Claimed(Lease {
                token: FencingToken(token),
                expires_at: Millis(row.try_get::<Option<i64>, _>(1).map_err(corrupt)?.unwrap_or(0)),
                resumed_from: None,
            }));
        }
        let mut now = Millis(row.try_get(2).map_err(corrupt)?);
        let existing = if row.try_get::<Option<String>, _>(3).map_err(corrupt)?.is_some() {
            decode_at(&row, 3)?
        } else {
            // The conflicting row was committed after this statement's snapshot
            // (we waited for its inserter), or a resumed record is gone: read afresh.
            let mut conn = self.pool.acquire().await.map_err(Retry::from)?;
            let (fresh_now, fresh) = self.fetch_with_now(&mut conn, &req.scope, false).await?;
            now = fresh_now;
            match fresh {
                Some(r) => r,
                None if req.resume.is_some() => return Ok(ClaimOutcome::Stale),
                None => return Err(Retry::Transient(sqlx::Error::RowNotFound)),
            }
        };
        let takeover = match Resolution::of(&existing, req, now)? {
            Resolution::Move { takeover } => takeover,
            Resolution::Settled(outcome) => return Ok(outcome),
        };
        fail::fail_point!("idemkit_postgres::claim::before_move");
        match self
            .move_claim(&self.pool, req, &existing, now, takeover, false)
            .await?
        {
            Some(lease) => Ok(ClaimOutcome::Claimed(lease)),
            // The record changed since it was read (completed by a lapsed holder,
            // heartbeaten, moved by another attempt): decide again on its new state.
            None => Err(Retry::Transient(sqlx::Error::RowNotFound)),
        }
    }

    /// Compare-and-swap of a record to a new holder, on a fresh token: takeover
    /// keeps its progress and generation, window reuse starts clean. It succeeds
    /// only if the record is still exactly as `seen` (token, state and lease): a
    /// record that completed, was heartbeaten, parked, released or moved in
    /// between is never reopened (SPEC §3). `None` when it changed. With
    /// `lift_lock_timeout`, the single-step claim's short `lock_timeout` is lifted
    /// for the handler's own statements in the same round trip.
    async fn move_claim<'c, E>(
        &self,
        executor: E,
        req: &ClaimRequest,
        seen: &Record,
        now: Millis,
        takeover: bool,
        lift_lock_timeout: bool,
    ) -> Result<Option<Lease>, Retry>
    where
        E: sqlx::Executor<'c, Database = Postgres>,
    {
        static MOVE: LazyLock<String> = LazyLock::new(|| {
            format!(
                "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, lease_expires_at = $3, \
                 state = 'in_flight', \
                 fingerprint = CASE WHEN $4 THEN fingerprint ELSE $5 END, \
                 created_at = CASE WHEN $4 THEN created_at ELSE $6 END, completed_at = NULL, \
                 recovery_point = CASE WHEN $4 THEN recovery_point END, \
                 step_outputs = CASE WHEN $4 THEN step_outputs ELSE '{{}}' END, \
                 req_method = $7, req_path = $8, req_headers = $9, req_body = $10, \
                 resp_status = NULL, resp_headers = NULL, resp_body = NULL, \
                 last_error = CASE WHEN $4 THEN last_error END \
                 WHERE account = $1 AND idem_key = $2 AND fencing_token = $11 AND state = $12 \
                 AND lease_expires_at = $13 \
                 RETURNING fencing_token, recovery_point, \
                 CASE WHEN $14 THEN set_config('lock_timeout', '0', true) END"
            )
        });
        let expires = now.plus(req.lease);
        let moved = sqlx::query(AssertSqlSafe(MOVE.as_str()))
            .bind(req.scope.account.as_str())
            .bind(req.scope.key.as_str())
            .bind(expires.0)
            .bind(takeover)
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(now.0)
            .bind(&req.request.method)
            .bind(&req.request.path)
            .bind(StoredHeader::encode_list(&req.request.headers)?)
            .bind(&req.request.body)
            .bind(seen.fencing_token.0)
            .bind(seen.state.as_str())
            .bind(seen.lease_expires_at.0)
            .bind(lift_lock_timeout)
            .fetch_optional(executor)
            .await
            .map_err(Retry::from)?;
        let Some(row) = moved else { return Ok(None) };
        Ok(Some(Lease {
            token: FencingToken(row.try_get(0).map_err(corrupt)?),
            expires_at: expires,
            // As written: a lapsed holder may have recorded progress since the read.
            resumed_from: if takeover {
                row.try_get(1).map_err(corrupt)?
            } else {
                None
            },
        }))
    }

    async fn fenced(
        &self,
        sql: &str,
        notify: bool,
        scope: &Scope,
        token: FencingToken,
        extra: impl Fn(
            sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments>,
    ) -> StoreResult<()> {
        let sql = if notify { notifying(sql) } else { sql.to_owned() };
        self.retrying(|| async {
            let q = sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(scope.account.as_str().to_owned())
                .bind(scope.key.as_str().to_owned())
                .bind(token.0);
            let changed = if notify {
                extra(q)
                    .fetch_one(&self.pool)
                    .await
                    .map_err(Retry::from)?
                    .try_get::<i64, _>(0)
                    .map_err(corrupt)? as u64
            } else {
                extra(q)
                    .execute(&self.pool)
                    .await
                    .map_err(Retry::from)?
                    .rows_affected()
            };
            if changed == 1 {
                Ok(())
            } else {
                Err(Retry::Fatal(StoreError::Fenced))
            }
        })
        .await
    }

    async fn complete_on(
        &self,
        conn: &mut PgConnection,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        notify: bool,
    ) -> Result<(), Retry> {
        static COMPLETE: LazyLock<String> = LazyLock::new(|| {
            format!(
                "UPDATE idemkit_keys SET state = 'completed', completed_at = {}, resp_status = $5, \
                 resp_headers = $6, resp_body = $7, last_error = NULL \
                 WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
                now_sql(4)
            )
        });
        static COMPLETE_NOTIFYING: LazyLock<String> = LazyLock::new(|| notifying(&COMPLETE));
        let sql = if notify { &*COMPLETE_NOTIFYING } else { &*COMPLETE };
        let q = sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .bind(token.0)
            .bind(self.test_now())
            .bind(i32::from(response.status))
            .bind(StoredHeader::encode_list(&response.headers)?)
            .bind(&response.body);
        let changed = if notify {
            q.fetch_one(&mut *conn)
                .await
                .map_err(Retry::from)?
                .try_get::<i64, _>(0)
                .map_err(corrupt)? as u64
        } else {
            q.execute(&mut *conn).await.map_err(Retry::from)?.rows_affected()
        };
        if changed == 1 {
            Ok(())
        } else {
            Err(Retry::Fatal(StoreError::Fenced))
        }
    }
}

/// The bound [`ADVANCE`] statement.
fn advance_query(
    scope: &Scope,
    token: FencingToken,
    update: &PhaseUpdate,
) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments> {
    let (name, value) = match &update.step {
        Some((name, value)) => (Some(name.clone()), Some(value.to_string())),
        None => (None, None),
    };
    sqlx::query(ADVANCE)
        .bind(scope.account.as_str().to_owned())
        .bind(scope.key.as_str().to_owned())
        .bind(token.0)
        .bind(update.recovery_point.clone())
        .bind(name)
        .bind(value)
}

/// An operation's failure: retry it (deadlock, serialization failure) or not.
#[derive(Debug)]
enum Retry {
    Transient(sqlx::Error),
    Fatal(StoreError),
}

impl Retry {
    fn into_store(self) -> StoreError {
        match self {
            Self::Transient(e) => StoreError::Unavailable(Box::new(e)),
            Self::Fatal(e) => e,
        }
    }
}

impl From<sqlx::Error> for Retry {
    fn from(e: sqlx::Error) -> Self {
        match sqlstate(&e).as_deref() {
            Some("40001" | "40P01") => Self::Transient(e),
            _ => Self::Fatal(map_err(e)),
        }
    }
}

impl From<StoreError> for Retry {
    fn from(e: StoreError) -> Self {
        Self::Fatal(e)
    }
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

#[async_trait]
impl KeyStore for PgStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.retrying(|| self.claim_autocommit(req)).await
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        static HEARTBEAT: LazyLock<String> = LazyLock::new(|| {
            format!(
                "UPDATE idemkit_keys SET lease_expires_at = {} + $5 \
                 WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight' \
                 RETURNING lease_expires_at",
                now_sql(4)
            )
        });
        self.retrying(|| async {
            let row = sqlx::query(AssertSqlSafe(HEARTBEAT.as_str()))
                .bind(scope.account.as_str())
                .bind(scope.key.as_str())
                .bind(token.0)
                .bind(self.test_now())
                .bind(lease_ms(lease))
                .fetch_optional(&self.pool)
                .await
                .map_err(Retry::from)?;
            match row {
                Some(row) => Ok(Millis(row.try_get(0).map_err(corrupt)?)),
                None => Err(Retry::Fatal(StoreError::Fenced)),
            }
        })
        .await
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        self.retrying(|| async {
            let mut conn = self.pool.acquire().await.map_err(Retry::from)?;
            self.complete_on(&mut conn, scope, token, response, true).await
        })
        .await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        // The row stays (state `released`, behaving as absent) so the next
        // claim's token is higher than any this record ever handed out.
        // A record with recorded progress is abandoned instead (see the trait).
        static RELEASE: LazyLock<String> = LazyLock::new(|| {
            const CLEAN: &str = "recovery_point IS NULL AND step_outputs = '{}'";
            format!(
                "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, \
                 state = CASE WHEN {CLEAN} THEN 'released' ELSE state END, \
                 lease_expires_at = CASE WHEN {CLEAN} THEN 0 ELSE {now} END, \
                 req_body = CASE WHEN {CLEAN} THEN ''::bytea ELSE req_body END, \
                 last_error = CASE WHEN {CLEAN} THEN last_error ELSE $5 END \
                 WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
                now = now_sql(4)
            )
        });
        let now = self.test_now();
        self.fenced(&RELEASE, true, scope, token, move |q| {
            q.bind(now).bind(RELEASE_REFUSED)
        })
        .await
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        // A fresh token: a heartbeat of this holder still on its way is refused.
        static ABANDON: LazyLock<String> = LazyLock::new(|| {
            format!(
                "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, lease_expires_at = {}, last_error = $5 \
                 WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
                now_sql(4)
            )
        });
        let now = self.test_now();
        self.fenced(&ABANDON, true, scope, token, move |q| {
            q.bind(now).bind(error.to_owned())
        })
        .await
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        fetch_record(&mut conn, scope, false)
            .await
            .map_err(Retry::into_store)
    }

    fn now(&self) -> Millis {
        self.clock.now()
    }

    fn notifies_changes(&self) -> bool {
        true
    }

    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.retrying(|| async {
            let changed = advance_query(scope, token, update)
                .execute(&self.pool)
                .await
                .map_err(Retry::from)?
                .rows_affected();
            if changed == 1 {
                Ok(())
            } else {
                Err(Retry::Fatal(StoreError::Fenced))
            }
        })
        .await
    }

    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        // Wakes waiters like release and abandon: their next claim answers `Parked`.
        static PARK: LazyLock<String> = LazyLock::new(|| {
            format!(
                "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, state = 'parked', \
                 lease_expires_at = {}, last_error = $5 \
                 WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
                now_sql(4)
            )
        });
        let now = self.test_now();
        self.fenced(&PARK, true, scope, token, move |q| {
            q.bind(now).bind(reason.to_owned())
        })
        .await
    }

    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        let rows = sqlx::query(AssertSqlSafe(SELECT_ABANDONED.as_str()))
            .bind(self.test_now())
            .bind(claimed_before.0)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.iter().map(|r| decode_at(r, 0)).collect()
    }

    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        let now = self.test_now();
        self.retrying(|| async {
            let row = sqlx::query(AssertSqlSafe(REAP.as_str()))
                .bind(before.0)
                .bind(now)
                .bind(MOVED_TO_REVIEW)
                .fetch_one(&self.pool)
                .await
                .map_err(Retry::from)?;
            let count = |i: usize| -> Result<u64, Retry> {
                Ok(u64::try_from(row.try_get::<i64, _>(i).map_err(corrupt)?).unwrap_or(0))
            };
            Ok(ReapReport {
                moved_to_review: count(0)?,
                deleted: count(1)?,
            })
        })
        .await
    }

    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        let rows = sqlx::query(
            "SELECT account, idem_key, state, created_at, reaped_at, recovery_point, step_outputs, \
             last_error, req_method, req_path, req_headers, req_body \
             FROM idemkit_review ORDER BY created_at, id LIMIT $1",
        )
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        rows.iter().map(decode_review).collect()
    }

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        let rows = sqlx::query(SELECT_LIST)
            .bind(filter.state.map(|s| s.as_str()))
            .bind(filter.account.as_ref().map(|a| a.as_str()))
            .bind(i64::try_from(filter.limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.iter().map(|r| decode_at(r, 0)).collect()
    }

    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.test_now();
        // Wakes waiters like a holder's release: their next claim runs the request.
        let sql = notifying(&FORCE_RELEASE);
        self.retrying(|| async {
            let changed: i64 = sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(scope.account.as_str())
                .bind(scope.key.as_str())
                .bind(now)
                .bind(FORCE_RELEASED)
                .fetch_one(&self.pool)
                .await
                .map_err(Retry::from)?
                .try_get(0)
                .map_err(corrupt)?;
            Ok(changed == 1)
        })
        .await
    }

    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        static DISCARD: LazyLock<String> = LazyLock::new(|| {
            notifying(&format!(
                "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, state = 'released', lease_expires_at = 0, \
                 recovery_point = NULL, step_outputs = '{{}}', req_body = ''::bytea, last_error = $4 \
                 WHERE account = $1 AND idem_key = $2 \
                 AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= {}))",
                now_sql(3)
            ))
        });
        let now = self.test_now();
        self.retrying(|| async {
            let changed: i64 = sqlx::query(AssertSqlSafe(DISCARD.as_str()))
                .bind(scope.account.as_str())
                .bind(scope.key.as_str())
                .bind(now)
                .bind(FORCE_RELEASED)
                .fetch_one(&self.pool)
                .await
                .map_err(Retry::from)?
                .try_get(0)
                .map_err(corrupt)?;
            Ok(changed == 1)
        })
        .await
    }

    async fn wait_for_change(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        // Subscribe first, then flag the record, so a completion that lands in
        // between is either seen by the caller's next claim or notified to us.
        let mut rx = self.changes.subscribe();
        let flagged = sqlx::query(
            "UPDATE idemkit_keys SET has_waiters = true \
             WHERE account = $1 AND idem_key = $2 AND state = 'in_flight' AND NOT has_waiters",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .execute(&self.pool)
        .await
        .map_err(map_err)?
        .rows_affected();
        if flagged == 0 {
            // Either another waiter flagged it (a notification will come), or the
            // record left `in_flight` before our flag (between the caller's claim
            // and now): that change sent no notification, so look once more.
            let in_flight: Option<bool> = sqlx::query_scalar(
                "SELECT state = 'in_flight' FROM idemkit_keys WHERE account = $1 AND idem_key = $2",
            )
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(map_err)?;
            if in_flight != Some(true) {
                return Ok(());
            }
        }
        let want = (scope.account.as_str(), scope.key.as_str());
        let wait = async {
            loop {
                match rx.recv().await {
                    Ok((account, key)) if (account.as_str(), key.as_str()) == want => return,
                    Ok(_) => {}
                    // Missed some: one of them may have been ours.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        };
        let _ = tokio::time::timeout(timeout, wait).await;
        Ok(())
    }
}

#[async_trait]
impl TransactionalStore for PgStore {
    type Tx = PgTx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<PgTx>> {
        let (existing, decision) = self.read_decision(req).await?;
        if let Some(outcome) = decision.settle(existing)? {
            return Ok(TxClaim::Other(outcome));
        }
        self.retrying(|| async {
            let mut tx = self.begin_claim(req.lock_wait).await?;
            match self.claim_on(&mut tx, req).await {
                Ok(Ok(lease)) => Ok(TxClaim::Claimed {
                    tx: PgTx {
                        tx,
                        single_step: true,
                    },
                    lease,
                }),
                Ok(Err(outcome)) => Ok(TxClaim::Other(outcome)),
                Err(Retry::Fatal(StoreError::Unavailable(e))) if is_lock_timeout(&*e) => {
                    // The holder's claim is still uncommitted after the allowed wait.
                    Ok(TxClaim::Other(ClaimOutcome::InProgress {
                        retry_after: Duration::from_secs(1),
                    }))
                }
                Err(e) => Err(e),
            }
        })
        .await
    }

    async fn commit(&self, tx: PgTx) -> StoreResult<()> {
        tx.commit().await.map_err(map_err)
    }

    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<PgTx> {
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        let held = sqlx::query(
            "SELECT 1 FROM idemkit_keys WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 \
             AND state = 'in_flight'",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .bind(token.0)
        .fetch_optional(&mut *tx)
        .await
        .map_err(map_err)?;
        if held.is_none() {
            return Err(StoreError::Fenced);
        }
        Ok(PgTx {
            tx,
            single_step: false,
        })
    }

    /// Runs on the caller's open transaction and does not commit: the phase's
    /// business writes and its progress commit together when the caller
    /// commits ([`PgTx::commit`]) or completes ([`TransactionalStore::complete_in_tx`]).
    /// Not retried: a deadlock aborts the caller's transaction, which must be
    /// run again as a whole.
    async fn advance_in_tx(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        let changed = advance_query(scope, token, update)
            .execute(&mut **tx)
            .await
            .map_err(map_err)?
            .rows_affected();
        if changed == 1 {
            Ok(())
        } else {
            Err(StoreError::Fenced)
        }
    }

    async fn complete_in_tx(
        &self,
        mut tx: PgTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        // On an error the transaction is dropped, rolling back the business writes.
        let notify = !tx.single_step;
        self.complete_on(&mut tx, scope, token, response, notify)
            .await
            .map_err(Retry::into_store)?;
        tx.tx.commit().await.map_err(map_err)
    }
}

fn is_lock_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<sqlx::Error>().and_then(sqlstate).as_deref() == Some("55P03")
}

async fn spawn_listener(
    pool: &PgPool,
    schema: String,
    changes: broadcast::Sender<(String, String)>,
) -> StoreResult<AbortOnDrop> {
    let mut listener = PgListener::connect_with(pool).await.map_err(map_err)?;
    listener.listen(CHANNEL).await.map_err(map_err)?;
    Ok(AbortOnDrop(tokio::spawn(async move {
        loop {
            match listener.recv().await {
                Ok(n) => {
                    if let Ok((s, account, key)) =
                        serde_json::from_str::<(String, String, String)>(n.payload())
                        && s == schema
                    {
                        let _ = changes.send((account, key));
                    }
                }
                Err(e) => {
                    // PgListener reconnects on the next recv; waiters are bounded
                    // by their own timeouts meanwhile.
                    tracing::warn!(error = %e, "idemkit-postgres: notification listener error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    })))
}

async fn fetch_record(conn: &mut PgConnection, scope: &Scope, lock: bool) -> Result<Option<Record>, Retry> {
    let sql = if lock {
        AssertSqlSafe(format!("{SELECT_RECORD} FOR UPDATE"))
    } else {
        AssertSqlSafe(SELECT_RECORD.to_owned())
    };
    let row = sqlx::query(sql)
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(Retry::from)?;
    row.map(|r| decode_at(&r, 0)).transpose().map_err(Retry::Fatal)
}

/// Reads the 18 record columns starting at `at` (0 for `SELECT_RECORD`).
fn decode_at(row: &PgRow, at: usize) -> StoreResult<Record> {
    let g = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
    Record::try_from(RecordRow {
        account: row.try_get(at).map_err(g)?,
        key: row.try_get(at + 1).map_err(g)?,
        fingerprint: row.try_get(at + 2).map_err(g)?,
        state: row.try_get(at + 3).map_err(g)?,
        created_at: row.try_get(at + 4).map_err(g)?,
        completed_at: row.try_get(at + 5).map_err(g)?,
        lease_expires_at: row.try_get(at + 6).map_err(g)?,
        fencing_token: row.try_get(at + 7).map_err(g)?,
        recovery_point: row.try_get(at + 8).map_err(g)?,
        step_outputs: row.try_get(at + 9).map_err(g)?,
        req_method: row.try_get(at + 10).map_err(g)?,
        req_path: row.try_get(at + 11).map_err(g)?,
        req_headers: row.try_get(at + 12).map_err(g)?,
        req_body: row.try_get(at + 13).map_err(g)?,
        resp_status: row.try_get::<Option<i32>, _>(at + 14).map_err(g)?.map(i64::from),
        resp_headers: row.try_get(at + 15).map_err(g)?,
        resp_body: row.try_get(at + 16).map_err(g)?,
        last_error: row.try_get(at + 17).map_err(g)?,
    })
}

/// Decodes a row of `idemkit_review` (columns in the order `review` selects).
fn decode_review(row: &PgRow) -> StoreResult<ReviewEntry> {
    let g = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
    ReviewEntry::try_from(ReviewRow {
        account: row.try_get(0).map_err(g)?,
        key: row.try_get(1).map_err(g)?,
        state: row.try_get(2).map_err(g)?,
        created_at: row.try_get(3).map_err(g)?,
        reaped_at: row.try_get(4).map_err(g)?,
        recovery_point: row.try_get(5).map_err(g)?,
        step_outputs: row.try_get(6).map_err(g)?,
        last_error: row.try_get(7).map_err(g)?,
        req_method: row.try_get(8).map_err(g)?,
        req_path: row.try_get(9).map_err(g)?,
        req_headers: row.try_get(10).map_err(g)?,
        req_body: row.try_get(11).map_err(g)?,
    })
}

/// A lease length in milliseconds, as SQL adds it to the store's clock.
fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
}

fn corrupt(e: sqlx::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// Normalises sqlx errors: connection loss, pool exhaustion, timeouts, server
/// shutdown and resource exhaustion are `Unavailable` (a retryable 503), as is a
/// lock wait that timed out; everything else is `Backend`.
fn map_err(e: sqlx::Error) -> StoreError {
    let unavailable = match &e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("57")
                || c == "55P03"
                || c == "40001"
                || c == "40P01"
        }),
        _ => false,
    };
    if unavailable {
        StoreError::Unavailable(Box::new(e))
    } else {
        StoreError::Backend(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert!(valid_schema("idemkit"));
        assert!(valid_schema("t_1"));
        assert!(!valid_schema("1t"));
        assert!(!valid_schema("a-b"));
        assert!(!valid_schema("a; drop table x"));
        assert!(!valid_schema(""));
        assert!(!valid_schema(&"a".repeat(64)));
    }
}
