//! # idemkit-sqlite
//!
//! The embedded default [`KeyStore`]: SQLite through sqlx, in WAL mode, with
//! embedded migrations. Claims are arbitrated by the table's primary key
//! `(account, idem_key)` with `INSERT … ON CONFLICT DO NOTHING RETURNING`; a
//! conflicting row is then read and moved on only by a compare-and-swap on its
//! fencing token, all inside one `BEGIN IMMEDIATE` transaction.
//!
//! It also implements [`TransactionalStore`]: single-step requests claim, write
//! their business rows and store the response in one SQLite transaction.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemkit_core::StoreError> {
//! use idemkit_sqlite::SqliteStore;
//! let store = SqliteStore::open("idemkit.db").await?;
//! # let _ = store; Ok(()) }
//! ```
//!
//! SQLite allows one writer at a time. In single-step mode the claim's
//! transaction is held while the handler runs, so concurrent duplicates queue
//! behind the first and then replay its stored response; other writers queue too
//! (up to the busy timeout). That is the right trade for an embedded store; use
//! PostgreSQL when many instances share keys.

use std::collections::HashSet;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::ReviewRow;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Clock, Decision, FORCE_RELEASED, FencingToken, Fingerprint, KeyStore, Lease,
    ListFilter, MOVED_TO_REVIEW, Millis, PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, RecordHead,
    RecordRow, Resolution, ReviewEntry, Scope, StoreError, StoreResult, StoredHeader, StoredRequest,
    StoredResponse, SystemClock, TransactionalStore, TxClaim,
};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::{Mutex, OwnedMutexGuard};

/// A write transaction on the store's database, as handed to single-step
/// handlers. It dereferences to the connection, so `&mut *tx` (or `&mut **tx`
/// through the layer's `Tx` extractor) is an sqlx executor. Dropping it rolls
/// back; [`SqliteTx::commit`] commits.
///
/// It also holds the store's in-process writer slot: SQLite admits one writer at
/// a time, and queueing writers on an async mutex is far cheaper than letting
/// them spin in SQLite's busy handler (which sleeps up to 100 ms per try).
pub struct SqliteTx {
    tx: sqlx::Transaction<'static, Sqlite>,
    _writer: OwnedMutexGuard<()>,
    /// Set when this transaction carries a single-step claim that is written,
    /// completed, at commit.
    pending: Option<PendingClaim>,
}

/// A single-step claim not yet written. SQLite runs one writer at a time and an
/// uncommitted claim is invisible to everyone else, so writing the claim row
/// when the handler finishes, already completed, costs one statement instead of
/// two (an in-flight insert plus a completing update) and arbitrates the same
/// way: the primary key makes the loser's INSERT (or compare-and-swap) fail.
struct PendingClaim {
    _marker: PendingMarker,
    /// `None`: no row existed, INSERT. `Some(head)`: replace the row exactly as it
    /// was read (token, state and lease), so a record that changed in between
    /// (completed by a lapsed holder, heartbeaten, parked) is never overwritten.
    replaces: Option<RecordHead>,
    token: FencingToken,
    keep_progress: bool,
    fingerprint: Fingerprint,
    request: StoredRequest,
    created_at: Millis,
}

/// Marks a scope as being claimed by a single-step request of this process, so
/// a concurrent duplicate in the same process answers "in progress" at once
/// instead of running its handler only to lose at commit.
struct PendingMarker {
    set: Arc<StdMutex<HashSet<(String, String)>>>,
    key: (String, String),
}

impl PendingMarker {
    fn acquire(set: &Arc<StdMutex<HashSet<(String, String)>>>, scope: &Scope) -> Option<Self> {
        let key = (scope.account.as_str().to_owned(), scope.key.as_str().to_owned());
        let inserted = set.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone());
        inserted.then(|| Self {
            set: set.clone(),
            key,
        })
    }
}

impl Drop for PendingMarker {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

impl SqliteTx {
    /// Commits the transaction.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }

    /// Rolls the transaction back (dropping it does the same).
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

impl Deref for SqliteTx {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.tx
    }
}

impl DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.tx
    }
}

impl std::fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SqliteTx { .. }")
    }
}

/// Embedded migrations (run by [`SqliteStore::from_pool`]).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

const SELECT_RECORD: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE account = ?1 AND idem_key = ?2";

/// The completer's work list: in-flight records whose lease has expired.
const SELECT_ABANDONED: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE state = 'in_flight' AND lease_expires_at <= ?1 AND created_at <= ?2 \
     ORDER BY created_at, account, idem_key LIMIT ?3";

/// Operator listing: records matching an optional state (`?1`) and account
/// (`?2`), newest claim first.
const SELECT_LIST: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR account = ?2) \
     ORDER BY created_at DESC, account, idem_key LIMIT ?3";

/// A [`KeyStore`] on SQLite.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    clock: Arc<dyn Clock>,
    /// One writer at a time in this process (see [`SqliteTx`]).
    writer: Arc<Mutex<()>>,
    /// Scopes with a single-step claim in progress in this process.
    pending: Arc<StdMutex<HashSet<(String, String)>>>,
}

/// Connection settings for [`SqliteStore::open_with`].
#[derive(Debug, Clone)]
pub struct SqliteConfig {
    /// Largest number of pooled connections (default 8).
    pub max_connections: u32,
    /// How long a writer waits for SQLite's write lock before the request fails
    /// with a retryable `503` (default 10 s).
    pub busy_timeout: Duration,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            max_connections: 8,
            busy_timeout: Duration::from_secs(10),
        }
    }
}

impl SqliteStore {
    /// Opens (creating if missing) the database file at `path` with defaults.
    pub async fn open(path: impl AsRef<Path>) -> StoreResult<Self> {
        Self::open_with(path, &SqliteConfig::default()).await
    }

    /// Opens the database at `path`, which may also be a `sqlite://` URL.
    pub async fn open_with(path: impl AsRef<Path>, config: &SqliteConfig) -> StoreResult<Self> {
        let path = path.as_ref();
        let options = match path.to_str() {
            Some(url) if url.starts_with("sqlite:") => {
                SqliteConnectOptions::from_str(url).map_err(backend)?
            }
            _ => SqliteConnectOptions::new().filename(path),
        }
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // NORMAL in WAL mode never corrupts; a power loss may drop the last commits.
        // Idempotency records are written in the same transaction as the business
        // rows, so they are lost (or kept) together.
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(config.busy_timeout)
        .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(config.max_connections)
            // A local file cannot drop a connection the way a network can; the
            // ping sqlx would send on every acquire is a wasted round trip.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(map_err)?;
        Self::from_pool(pool).await
    }

    /// Uses an existing pool (the application's own, so business tables and keys
    /// live in one database), running the embedded migrations.
    pub async fn from_pool(pool: SqlitePool) -> StoreResult<Self> {
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| StoreError::Backend(Box::new(e)))?;
        Ok(Self {
            pool,
            clock: Arc::new(SystemClock),
            writer: Arc::new(Mutex::new(())),
            pending: Arc::default(),
        })
    }

    /// Replaces the clock (tests move time with it).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Opens a write transaction: waits for this process's writer slot, then
    /// `BEGIN IMMEDIATE`, which takes SQLite's write lock up front (other
    /// processes wait up to the busy timeout), so the read that follows a
    /// conflicting insert cannot go stale. Use it for the application's own
    /// writes too, so they queue with the store's instead of contending.
    pub async fn begin(&self) -> StoreResult<SqliteTx> {
        let writer = self.writer.clone().lock_owned().await;
        let tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(map_err)?;
        Ok(SqliteTx {
            tx,
            _writer: writer,
            pending: None,
        })
    }

    /// Claims inside `tx`. Returns the lease when claimed, or the outcome to answer.
    async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest,
    ) -> StoreResult<Result<Lease, ClaimOutcome>> {
        let now = self.clock.now();
        let expires = now.plus(req.lease);
        let headers = StoredHeader::encode_list(&req.request.headers)?;
        let inserted = sqlx::query(
            "INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, lease_expires_at, \
             fencing_token, req_method, req_path, req_headers, req_body) \
             VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5, (SELECT floor + 1 FROM idemkit_token_floor), \
             ?6, ?7, ?8, ?9) ON CONFLICT (account, idem_key) DO NOTHING RETURNING fencing_token",
        )
        .bind(req.scope.account.as_str())
        .bind(req.scope.key.as_str())
        .bind(&req.fingerprint.as_bytes()[..])
        .bind(now.0)
        .bind(expires.0)
        .bind(&req.request.method)
        .bind(&req.request.path)
        .bind(&headers)
        .bind(&req.request.body)
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_err)?;
        if let Some(row) = inserted {
            let token: i64 = row.try_get(0).map_err(corrupt)?;
            return Ok(Ok(Lease {
                token: FencingToken(token),
                expires_at: expires,
                resumed_from: None,
            }));
        }

        let existing = fetch_record(&mut *conn, &req.scope).await?.ok_or_else(|| {
            StoreError::Corrupt("insert conflicted but no row was found under the write lock".into())
        })?;
        let takeover = match Resolution::of(&existing, req, now)? {
            Resolution::Move { takeover } => takeover,
            Resolution::Settled(outcome) => return Ok(Err(outcome)),
        };
        let next = FencingToken(existing.fencing_token.0 + 1);
        // Takeover keeps the claim's progress and request; window reuse starts clean.
        let moved = sqlx::query(
            "UPDATE idemkit_keys SET fencing_token = ?3, lease_expires_at = ?4, state = 'in_flight', \
             fingerprint = CASE WHEN ?5 THEN fingerprint ELSE ?6 END, \
             created_at = CASE WHEN ?5 THEN created_at ELSE ?7 END, completed_at = NULL, \
             recovery_point = CASE WHEN ?5 THEN recovery_point END, \
             step_outputs = CASE WHEN ?5 THEN step_outputs ELSE '{}' END, \
             req_method = ?8, req_path = ?9, req_headers = ?10, req_body = ?11, \
             resp_status = NULL, resp_headers = NULL, resp_body = NULL, \
             last_error = CASE WHEN ?5 THEN last_error END \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?12",
        )
        .bind(req.scope.account.as_str())
        .bind(req.scope.key.as_str())
        .bind(next.0)
        .bind(expires.0)
        .bind(takeover)
        .bind(&req.fingerprint.as_bytes()[..])
        .bind(now.0)
        .bind(&req.request.method)
        .bind(&req.request.path)
        .bind(&headers)
        .bind(&req.request.body)
        .bind(existing.fencing_token.0)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?;
        cas_ok(moved.rows_affected())?;
        let resumed_from = if takeover { existing.recovery_point } else { None };
        Ok(Ok(Lease {
            token: next,
            expires_at: expires,
            resumed_from,
        }))
    }

    /// Reads the record with a plain read (no write lock) and decides. A
    /// completed record within its window is immutable and an in-flight one with
    /// a live lease is in progress at the moment it was read, so those answers
    /// need no lock; the others are confirmed by the atomic write that follows.
    async fn read_decision(&self, req: &ClaimRequest) -> StoreResult<(Option<Record>, Decision)> {
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        let existing = fetch_record(&mut conn, &req.scope).await?;
        let decision = req.decide(existing.as_ref().map(RecordHead::from).as_ref(), self.clock.now());
        Ok((existing, decision))
    }

    /// Runs a fenced single-row update; zero rows means the token is stale.
    async fn fenced_update(
        &self,
        conn: &mut SqliteConnection,
        sql: &'static str,
        scope: &Scope,
        token: FencingToken,
        bind: impl FnOnce(
            sqlx::query::Query<'static, Sqlite, sqlx::sqlite::SqliteArguments>,
        ) -> sqlx::query::Query<'static, Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> StoreResult<()> {
        let q = sqlx::query(sql)
            .bind(scope.account.as_str().to_owned())
            .bind(scope.key.as_str().to_owned())
            .bind(token.0);
        let done = bind(q).execute(&mut *conn).await.map_err(map_err)?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(StoreError::Fenced)
        }
    }

    /// Writes a pending single-step claim as a completed record. The primary key
    /// (INSERT) or the token compare-and-swap (UPDATE) arbitrates: a miss means
    /// another request with this key committed first → [`StoreError::Conflict`].
    async fn write_completed_claim(
        &self,
        conn: &mut SqliteConnection,
        scope: &Scope,
        token: FencingToken,
        p: PendingClaim,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        if p.token != token {
            return Err(StoreError::Fenced);
        }
        let now = self.clock.now();
        let sql = match p.replaces {
            None => {
                "INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, completed_at, \
                 lease_expires_at, fencing_token, req_method, req_path, req_headers, req_body, resp_status, \
                 resp_headers, resp_body) \
                 VALUES (?1, ?2, ?3, 'completed', ?4, ?5, ?5, \
                 MAX(?6, (SELECT floor + 1 FROM idemkit_token_floor)), ?7, ?8, ?9, ?10, ?11, ?12, ?13) \
                 ON CONFLICT (account, idem_key) DO NOTHING"
            }
            Some(_) => {
                "UPDATE idemkit_keys SET fingerprint = ?3, state = 'completed', \
                 created_at = CASE WHEN ?15 THEN created_at ELSE ?4 END, completed_at = ?5, \
                 lease_expires_at = ?5, fencing_token = ?6, req_method = ?7, req_path = ?8, req_headers = ?9, \
                 req_body = ?10, resp_status = ?11, resp_headers = ?12, resp_body = ?13, last_error = NULL, \
                 recovery_point = CASE WHEN ?15 THEN recovery_point END, \
                 step_outputs = CASE WHEN ?15 THEN step_outputs ELSE '{}' END \
                 WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?14 AND state = ?16 \
                 AND lease_expires_at = ?17"
            }
        };
        let done = sqlx::query(sql)
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .bind(&p.fingerprint.as_bytes()[..])
            .bind(p.created_at.0)
            .bind(now.0)
            .bind(p.token.0)
            .bind(&p.request.method)
            .bind(&p.request.path)
            .bind(StoredHeader::encode_list(&p.request.headers)?)
            .bind(&p.request.body)
            .bind(i64::from(response.status))
            .bind(StoredHeader::encode_list(&response.headers)?)
            .bind(&response.body)
            .bind(p.replaces.map_or(0, |h| h.fencing_token.0))
            .bind(p.keep_progress)
            .bind(p.replaces.map_or("", |h| h.state.as_str()))
            .bind(p.replaces.map_or(0, |h| h.lease_expires_at.0))
            .execute(&mut *conn)
            .await
            .map_err(map_err)?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(StoreError::Conflict)
        }
    }

    async fn complete_on(
        &self,
        conn: &mut SqliteConnection,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let headers = StoredHeader::encode_list(&response.headers)?;
        let now = self.clock.now().0;
        let status = i64::from(response.status);
        let body = response.body.clone();
        self.fenced_update(
            conn,
            "UPDATE idemkit_keys SET state = 'completed', completed_at = ?4, resp_status = ?5, \
             resp_headers = ?6, resp_body = ?7, last_error = NULL \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'",
            scope,
            token,
            move |q| q.bind(now).bind(status).bind(headers).bind(body),
        )
        .await
    }

    /// Saves a phase's progress (fenced). A step output is merged into the JSON
    /// object in Rust: SQLite's JSON paths cannot address every key (a `"` in a
    /// step name), and `json_patch` would merge nested objects instead of
    /// replacing the output. The read and the write share the transaction's
    /// write lock, so no other writer can interleave.
    async fn advance_on(
        &self,
        conn: &mut SqliteConnection,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        let outputs = match &update.step {
            None => None,
            Some((name, value)) => {
                let current: Option<String> = sqlx::query_scalar(
                    "SELECT step_outputs FROM idemkit_keys WHERE account = ?1 AND idem_key = ?2 \
                     AND fencing_token = ?3 AND state = 'in_flight'",
                )
                .bind(scope.account.as_str())
                .bind(scope.key.as_str())
                .bind(token.0)
                .fetch_optional(&mut *conn)
                .await
                .map_err(map_err)?;
                let current = current.ok_or(StoreError::Fenced)?;
                let mut map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&current)
                    .map_err(|e| StoreError::Corrupt(format!("step outputs: {e}")))?;
                map.insert(name.clone(), value.clone());
                Some(serde_json::to_string(&map).map_err(|e| StoreError::Corrupt(e.to_string()))?)
            }
        };
        let point = update.recovery_point.clone();
        self.fenced_update(
            conn,
            "UPDATE idemkit_keys SET recovery_point = ?4, step_outputs = COALESCE(?5, step_outputs) \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'",
            scope,
            token,
            move |q| q.bind(point).bind(outputs),
        )
        .await
    }
}

#[async_trait]
impl KeyStore for SqliteStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        let (existing, decision) = self.read_decision(req).await?;
        if let Some(outcome) = decision.settle(existing)? {
            return Ok(outcome);
        }
        let mut tx = self.begin().await?;
        match self.claim_on(&mut tx, req).await? {
            Ok(lease) => {
                tx.commit().await.map_err(map_err)?;
                Ok(ClaimOutcome::Claimed(lease))
            }
            Err(outcome) => Ok(outcome),
        }
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        let expires = self.clock.now().plus(lease);
        let mut tx = self.begin().await?;
        self.fenced_update(
            &mut tx,
            "UPDATE idemkit_keys SET lease_expires_at = ?4 \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'",
            scope,
            token,
            move |q| q.bind(expires.0),
        )
        .await?;
        tx.commit().await.map_err(map_err)?;
        Ok(expires)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let tx = self.begin().await?;
        self.complete_in_tx(tx, scope, token, response).await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        // The row stays (state `released`, behaving as absent) so the next claim's
        // token is higher than any this record ever handed out.
        // A record with recorded progress is abandoned instead (see the trait).
        let now = self.clock.now().0;
        self.fenced_update(
            &mut tx,
            "UPDATE idemkit_keys SET fencing_token = fencing_token + 1, \
             state = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 'released' ELSE state END, \
             lease_expires_at = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 0 ELSE ?4 END, \
             req_body = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN x'' ELSE req_body END, \
             last_error = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN last_error ELSE ?5 END \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'",
            scope,
            token,
            move |q| q.bind(now).bind(RELEASE_REFUSED),
        )
        .await?;
        tx.commit().await.map_err(map_err)
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let now = self.clock.now().0;
        let error = error.to_owned();
        let mut tx = self.begin().await?;
        self.fenced_update(
            &mut tx,
            "UPDATE idemkit_keys SET fencing_token = fencing_token + 1, lease_expires_at = ?4, last_error = ?5 \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'",
            scope,
            token,
            move |q| q.bind(now).bind(error),
        )
        .await?;
        tx.commit().await.map_err(map_err)
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        fetch_record(&mut conn, scope).await
    }

    fn now(&self) -> Millis {
        self.clock.now()
    }

    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        self.advance_on(&mut tx, scope, token, update).await?;
        tx.commit().await.map_err(map_err)
    }

    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        let now = self.clock.now().0;
        let reason = reason.to_owned();
        let mut tx = self.begin().await?;
        self.fenced_update(
            &mut tx,
            "UPDATE idemkit_keys SET fencing_token = fencing_token + 1, state = 'parked', \
             lease_expires_at = ?4, last_error = ?5 \
             WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'",
            scope,
            token,
            move |q| q.bind(now).bind(reason),
        )
        .await?;
        tx.commit().await.map_err(map_err)
    }

    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        let rows = sqlx::query(SELECT_ABANDONED)
            .bind(self.clock.now().0)
            .bind(claimed_before.0)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.iter().map(|r| decode_at(r, 0)).collect()
    }

    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        let now = self.clock.now().0;
        // One transaction: a record is either still in the key table or in the
        // review table, never in both or neither.
        let mut tx = self.begin().await?;
        // Never completed and claimed before `?1`: in flight with a lease expired
        // at `?2` (now), or parked; live leases never match. Each is listed once
        // (a review entry of the same claim means it was listed already), and the
        // record stays, parked, so it keeps fencing and is never claimed again as
        // a new request.
        const UNFINISHED: &str = "created_at < ?1 \
             AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?2)) \
             AND NOT EXISTS (SELECT 1 FROM idemkit_review r WHERE r.account = idemkit_keys.account \
             AND r.idem_key = idemkit_keys.idem_key AND r.created_at = idemkit_keys.created_at)";
        let moved = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO idemkit_review (account, idem_key, state, created_at, reaped_at, recovery_point, \
             step_outputs, last_error, req_method, req_path, req_headers, req_body) \
             SELECT account, idem_key, state, created_at, ?2, recovery_point, step_outputs, last_error, \
             req_method, req_path, req_headers, req_body FROM idemkit_keys WHERE {UNFINISHED} \
             ORDER BY created_at, account, idem_key"
        )))
        .bind(before.0)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?
        .rows_affected();
        let parked = sqlx::query(
            "UPDATE idemkit_keys SET fencing_token = fencing_token + 1, state = 'parked', \
             lease_expires_at = MIN(lease_expires_at, ?2), last_error = ?3 \
             WHERE created_at < ?1 AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?2)) \
             AND (last_error IS NULL OR last_error <> ?3)",
        )
        .bind(before.0)
        .bind(now)
        .bind(MOVED_TO_REVIEW)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?
        .rows_affected();
        if parked != moved {
            return Err(StoreError::Corrupt(format!(
                "reaper listed {moved} records for review but parked {parked}"
            )));
        }
        // completed_at >= created_at, so the created_at bound only lets the
        // created_at index narrow the scan. The floor is raised first, in the same
        // transaction, so no later claim of a deleted key reuses one of its tokens.
        const EXPIRED: &str = "created_at < ?1 AND \
             ((state = 'completed' AND COALESCE(completed_at, created_at) < ?1) OR state = 'released')";
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE idemkit_token_floor SET floor = MAX(floor, \
             COALESCE((SELECT MAX(fencing_token) FROM idemkit_keys WHERE {EXPIRED}), 0))"
        )))
        .bind(before.0)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        let deleted = sqlx::query(AssertSqlSafe(format!("DELETE FROM idemkit_keys WHERE {EXPIRED}")))
            .bind(before.0)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?
            .rows_affected();
        tx.commit().await.map_err(map_err)?;
        Ok(ReapReport {
            deleted,
            moved_to_review: moved,
        })
    }

    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        let rows = sqlx::query(
            "SELECT account, idem_key, state, created_at, reaped_at, recovery_point, step_outputs, \
             last_error, req_method, req_path, req_headers, req_body \
             FROM idemkit_review ORDER BY created_at, id LIMIT ?1",
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

    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        self.discard_on(scope).await
    }

    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.clock.now().0;
        let mut tx = self.begin().await?;
        // The same tombstone as `release` (or, with recorded progress, resumable:
        // see the trait); the state check replaces the token check.
        let changed = sqlx::query(
            "UPDATE idemkit_keys SET fencing_token = fencing_token + 1, last_error = ?4, \
             state = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 'released' ELSE 'in_flight' END, \
             lease_expires_at = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 0 \
             ELSE MIN(lease_expires_at, ?3) END, \
             req_body = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN x'' ELSE req_body END \
             WHERE account = ?1 AND idem_key = ?2 \
             AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?3))",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .bind(now)
        .bind(FORCE_RELEASED)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?
        .rows_affected();
        tx.commit().await.map_err(map_err)?;
        Ok(changed == 1)
    }
}

impl SqliteStore {
    /// [`KeyStore::discard_progress`] in one statement.
    async fn discard_on(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.clock.now().0;
        let mut tx = self.begin().await?;
        let changed = sqlx::query(
            "UPDATE idemkit_keys SET fencing_token = fencing_token + 1, state = 'released', \
             lease_expires_at = 0, recovery_point = NULL, step_outputs = '{}', req_body = x'', last_error = ?4 \
             WHERE account = ?1 AND idem_key = ?2 \
             AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?3))",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .bind(now)
        .bind(FORCE_RELEASED)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?
        .rows_affected();
        tx.commit().await.map_err(map_err)?;
        Ok(changed == 1)
    }
}

#[async_trait]
impl TransactionalStore for SqliteStore {
    type Tx = SqliteTx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<SqliteTx>> {
        let (existing, decision) = self.read_decision(req).await?;
        if let Some(outcome) = decision.settle(existing.clone())? {
            return Ok(TxClaim::Other(outcome));
        }
        let Some(marker) = PendingMarker::acquire(&self.pending, &req.scope) else {
            // The same key is being claimed by a single-step request of this process.
            return Ok(TxClaim::Other(ClaimOutcome::InProgress {
                retry_after: Duration::from_secs(1),
            }));
        };
        let replaces = existing.as_ref().map(RecordHead::from);
        // An insert's token is raised to the reaper's floor when it is written.
        let token = FencingToken(replaces.map_or(1, |h| h.fencing_token.0 + 1));
        let resumed_from = match decision {
            Decision::Takeover => existing.and_then(|r| r.recovery_point),
            _ => None,
        };
        let mut tx = self.begin().await?;
        let now = self.clock.now();
        tx.pending = Some(PendingClaim {
            _marker: marker,
            replaces,
            token,
            keep_progress: decision == Decision::Takeover,
            fingerprint: req.fingerprint,
            request: req.request.clone(),
            created_at: now,
        });
        let lease = Lease {
            token,
            expires_at: now.plus(req.lease),
            resumed_from,
        };
        Ok(TxClaim::Claimed { tx, lease })
    }

    async fn commit(&self, tx: SqliteTx) -> StoreResult<()> {
        if tx.pending.is_some() {
            // A single-step claim is written when the request completes.
            return Err(StoreError::Unsupported(
                "committing a single-step claim without completing it",
            ));
        }
        tx.commit().await.map_err(map_err)
    }

    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<SqliteTx> {
        let mut tx = self.begin().await?;
        let held = sqlx::query(
            "SELECT 1 FROM idemkit_keys WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 \
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
        Ok(tx)
    }

    /// Phases run in lease mode, in transactions opened with
    /// [`TransactionalStore::begin_fenced`]. A transaction carrying a pending
    /// single-step claim has no committed record to advance (the claim is
    /// written, completed, at commit), so it answers
    /// [`StoreError::Unsupported`].
    async fn advance_in_tx(
        &self,
        tx: &mut SqliteTx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        if tx.pending.is_some() {
            return Err(StoreError::Unsupported("phases inside a single-step claim"));
        }
        self.advance_on(tx, scope, token, update).await
    }

    async fn complete_in_tx(
        &self,
        mut tx: SqliteTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        // On an error the transaction is dropped, which rolls back the business writes.
        match tx.pending.take() {
            Some(pending) => {
                self.write_completed_claim(&mut tx, scope, token, pending, response)
                    .await?
            }
            None => self.complete_on(&mut tx, scope, token, response).await?,
        }
        tx.commit().await.map_err(map_err)
    }
}

async fn fetch_record(conn: &mut SqliteConnection, scope: &Scope) -> StoreResult<Option<Record>> {
    let row = sqlx::query(SELECT_RECORD)
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_err)?;
    row.map(|r| decode_at(&r, 0)).transpose()
}

/// Reads the 18 record columns starting at `at` (0 for `SELECT_RECORD`).
fn decode_at(row: &SqliteRow, at: usize) -> StoreResult<Record> {
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
        resp_status: row.try_get(at + 14).map_err(g)?,
        resp_headers: row.try_get(at + 15).map_err(g)?,
        resp_body: row.try_get(at + 16).map_err(g)?,
        last_error: row.try_get(at + 17).map_err(g)?,
    })
}

/// Decodes a row of `idemkit_review` (columns in the order `review` selects).
fn decode_review(row: &SqliteRow) -> StoreResult<ReviewEntry> {
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

fn cas_ok(rows: u64) -> StoreResult<()> {
    // Under the write lock the row cannot change between the read and the update;
    // a miss means something outside this store wrote to the table.
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::Corrupt("record changed under the write lock".into()))
    }
}

fn corrupt(e: sqlx::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn backend(e: sqlx::Error) -> StoreError {
    StoreError::Backend(Box::new(e))
}

/// Normalises sqlx errors: lock contention, pool exhaustion and I/O are
/// `Unavailable` (a retryable 503); everything else is `Backend`.
fn map_err(e: sqlx::Error) -> StoreError {
    let unavailable = match &e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            // SQLITE_BUSY (5), SQLITE_LOCKED (6) and their extended codes.
            let code = db.code().and_then(|c| c.parse::<i32>().ok()).unwrap_or(0);
            matches!(code & 0xff, 5 | 6)
        }
        _ => false,
    };
    if unavailable {
        StoreError::Unavailable(Box::new(e))
    } else {
        backend(e)
    }
}
