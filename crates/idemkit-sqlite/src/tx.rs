//! Single-step mode: [`SqliteTx`], the pending claim it carries, and the
//! [`TransactionalStore`] implementation.

use std::collections::HashSet;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Decision, FencingToken, Fingerprint, Lease, Millis, PhaseUpdate, RecordHead,
    Scope, StoreError, StoreResult, StoredRequest, StoredResponse, TransactionalStore, TxClaim,
};
use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqliteConnection};
use tokio::sync::OwnedMutexGuard;

use crate::SqliteStore;
use crate::decode::fetch_record;
use crate::error::map_err;
use crate::sql;

/// A write transaction on the store's database, as handed to single-step
/// handlers. It dereferences to the connection, so `&mut *tx` (or `&mut **tx`
/// through the layer's `Tx` extractor) is an sqlx executor. Dropping it rolls
/// back; [`SqliteTx::commit`] commits.
///
/// It also holds the store's in-process writer slot: SQLite admits one writer at
/// a time, and queueing writers on an async mutex is far cheaper than letting
/// them spin in SQLite's busy handler (which sleeps up to 100 ms per try).
///
/// The transaction is SQLite's own (`BEGIN IMMEDIATE` … `COMMIT`), not an
/// `sqlx::Transaction`, so a single-step completion can send its record and the
/// `COMMIT` in one call to the connection's worker thread. A handler cannot
/// open a nested transaction with sqlx's `Connection::begin` on it (SQLite
/// refuses: "cannot start a transaction within a transaction"); a
/// `SAVEPOINT name` statement works.
pub struct SqliteTx {
    /// Taken by `commit`/`rollback`; when still here on drop, rolled back.
    conn: Option<PoolConnection<Sqlite>>,
    writer: Option<OwnedMutexGuard<()>>,
    /// Set when this transaction carries a single-step claim that is written,
    /// completed, at commit.
    pending: Option<PendingClaim>,
}

/// A single-step claim not yet written. SQLite runs one writer at a time and an
/// uncommitted claim is invisible to everyone else, so writing the claim row
/// when the handler finishes, already completed, costs one statement instead of
/// two (an in-flight insert plus a completing update) and arbitrates the same
/// way: the primary key makes the loser's INSERT (or compare-and-swap) fail.
pub(crate) struct PendingClaim {
    _marker: PendingMarker,
    /// `None`: no row existed, INSERT. `Some(head)`: replace the row exactly as it
    /// was read (token, state and lease), so a record that changed in between
    /// (completed by a lapsed holder, heartbeaten, parked) is never overwritten.
    pub(crate) replaces: Option<RecordHead>,
    pub(crate) token: FencingToken,
    pub(crate) keep_progress: bool,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) request: StoredRequest,
    pub(crate) created_at: Millis,
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
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        self.finish("COMMIT").await
    }

    /// Rolls the transaction back now (dropping it does the same). An `Err`
    /// says SQLite did not confirm it; the connection then goes back to the
    /// pool with its transaction still open, and the pool rolls it back.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        self.finish("ROLLBACK").await
    }

    /// Runs `statement` (whose last statement ends the transaction) and lets
    /// the connection and the writer slot go. When it fails the transaction may
    /// still be open: dropping `self` rolls it back.
    pub(crate) async fn finish_with<'q>(
        &mut self,
        statement: sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> Result<(), sqlx::Error> {
        statement.execute(&mut **self).await?;
        self.conn = None;
        self.writer = None;
        Ok(())
    }

    async fn finish(&mut self, statement: &'static str) -> Result<(), sqlx::Error> {
        self.finish_with(sqlx::query(statement)).await
    }
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else { return };
        let writer = self.writer.take();
        match tokio::runtime::Handle::try_current() {
            // The writer slot is held until the rollback has released SQLite's lock.
            Ok(runtime) => {
                runtime.spawn(async move {
                    if sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err() {
                        conn.close_on_drop();
                    }
                    drop(writer);
                });
            }
            // No runtime to roll back on: the connection leaves the pool and is
            // closed with it, which rolls back (closing through the pool would
            // need a runtime).
            Err(_) => drop(conn.detach()),
        }
    }
}

impl Deref for SqliteTx {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        self.conn.as_ref().expect("an open transaction")
    }
}

impl DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.conn.as_mut().expect("an open transaction")
    }
}

impl std::fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SqliteTx { .. }")
    }
}

/// A pooled connection outside any transaction, holding the writer slot: for
/// a write that is one statement, which SQLite makes atomic on its own, so it
/// needs neither `BEGIN IMMEDIATE` nor `COMMIT` (two calls to the connection's
/// worker thread fewer). A caller cancelled mid-statement leaves no transaction
/// open: the statement runs to its end on the worker or not at all.
pub(crate) struct Solo {
    conn: PoolConnection<Sqlite>,
    _writer: OwnedMutexGuard<()>,
}

impl Deref for Solo {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.conn
    }
}

impl DerefMut for Solo {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.conn
    }
}

impl SqliteStore {
    /// A connection for one autocommitted write statement (see [`Solo`]).
    pub(crate) async fn solo(&self) -> StoreResult<Solo> {
        self.solo_on(&self.pool).await
    }

    /// [`Self::solo`] for the lease-mode claim of an absent key: on the
    /// connection that syncs its commits, under [`crate::Durability::Claims`].
    pub(crate) async fn solo_for_claim(&self) -> StoreResult<Solo> {
        self.solo_on(self.claims.as_ref().unwrap_or(&self.pool)).await
    }

    async fn solo_on(&self, pool: &sqlx::SqlitePool) -> StoreResult<Solo> {
        let writer = self.writer.clone().lock_owned().await;
        let conn = pool.acquire().await.map_err(map_err)?;
        Ok(Solo {
            conn,
            _writer: writer,
        })
    }

    /// Opens a write transaction: waits for this process's writer slot, then
    /// `BEGIN IMMEDIATE`, which takes SQLite's write lock up front (other
    /// processes wait up to the busy timeout), so the read that follows a
    /// conflicting insert cannot go stale. Use it for the application's own
    /// writes too, so they queue with the store's instead of contending.
    pub async fn begin(&self) -> StoreResult<SqliteTx> {
        self.begin_on(&self.pool).await
    }

    /// [`Self::begin`] for a lease-mode claim that moves a record (a key
    /// released or past its window claimed again, a takeover): on the
    /// connection that syncs its commits, under [`crate::Durability::Claims`].
    pub(crate) async fn begin_for_claim(&self) -> StoreResult<SqliteTx> {
        self.begin_on(self.claims.as_ref().unwrap_or(&self.pool)).await
    }

    async fn begin_on(&self, pool: &sqlx::SqlitePool) -> StoreResult<SqliteTx> {
        let writer = self.writer.clone().lock_owned().await;
        let conn = pool.acquire().await.map_err(map_err)?;
        // The handle exists before `BEGIN` is sent: if this future is dropped
        // once it has been, dropping the handle rolls the transaction back
        // rather than returning a connection inside it to the pool.
        let mut tx = SqliteTx {
            conn: Some(conn),
            writer: Some(writer),
            pending: None,
        };
        // On an error `tx` is dropped too: its rollback finds no transaction
        // (SQLite then refuses it and the connection is closed, not reused).
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        Ok(tx)
    }
}

#[async_trait]
impl TransactionalStore for SqliteStore {
    type Tx = SqliteTx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<SqliteTx>> {
        // A key with no row this process knows of is claimed without reading
        // it: the insert at commit arbitrates (a row written meanwhile by
        // another process fails it, and everything rolls back).
        let (existing, decision) = if self.assume_absent(req) {
            (None, Decision::Insert)
        } else {
            self.read_decision(req).await?
        };
        if let Some(outcome) = decision.settle(existing.clone())? {
            return Ok(TxClaim::Other(outcome));
        }
        let Some(marker) = PendingMarker::acquire(&self.pending, &req.scope) else {
            // The same key is being claimed by a single-step request of this process.
            return Ok(TxClaim::Other(ClaimOutcome::InProgress {
                retry_after: Duration::from_secs(1),
            }));
        };
        let mut tx = self.begin().await?;
        let (existing, decision) = if existing.is_none() {
            // Absent (assumed or read): nothing is handed to the handler from
            // a record, and a row written meanwhile fails the insert at commit.
            (existing, decision)
        } else {
            // Read again under the write lock, held until commit: the read
            // above took no lock, and a lapsed holder's fenced write in between
            // (its token is still the record's) moves the recovery point and
            // the step outputs without changing the token, state or lease the
            // commit compares. The handler is given what the record holds now.
            let fresh = match fetch_record(&mut tx, &req.scope).await {
                Ok(fresh) => fresh,
                Err(e) => {
                    self.rollback_tx(tx).await;
                    return Err(e);
                }
            };
            let decision = req.decide(fresh.as_ref().map(RecordHead::from).as_ref(), self.clock.now());
            match decision.settle(fresh.clone()) {
                Ok(None) => (fresh, decision),
                settled => {
                    // Changed meanwhile into something to answer (completed,
                    // heartbeaten, parked): the lock is let go before the answer.
                    self.rollback_tx(tx).await;
                    return settled.and_then(|outcome| {
                        outcome.map(TxClaim::Other).ok_or_else(|| {
                            StoreError::Corrupt("a settled decision without an outcome".into())
                        })
                    });
                }
            }
        };
        let replaces = existing.as_ref().map(RecordHead::from);
        // An insert's token is raised to the reaper's floor when it is written.
        let token = FencingToken(replaces.map_or(1, |h| h.fencing_token.0 + 1));
        let resumed_from = match decision {
            Decision::Takeover => existing.and_then(|r| r.recovery_point),
            _ => None,
        };
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
        let held = sqlx::query(sql::HELD)
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

    /// `ROLLBACK` now: the write lock and the writer slot are free when this
    /// returns. If it fails, the dropped transaction rolls back (or closes its
    /// connection) by itself.
    async fn rollback_tx(&self, tx: SqliteTx) {
        let _ = tx.rollback().await;
    }

    async fn complete_in_tx(
        &self,
        mut tx: SqliteTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        // On an error the transaction is dropped, which rolls back the business writes.
        if let Some(pending) = tx.pending.take() {
            return self
                .complete_pending_claim(tx, scope, token, pending, response)
                .await;
        }
        self.complete_on(&mut tx, scope, token, response).await?;
        tx.commit().await.map_err(map_err)
    }
}
