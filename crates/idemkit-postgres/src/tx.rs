//! Single-step mode: [`PgTx`] and the [`TransactionalStore`] implementation.

use std::ops::{Deref, DerefMut};

use async_trait::async_trait;
use idemkit_core::{
    ClaimRequest, FencingToken, Lease, PhaseUpdate, Scope, StoreError, StoreResult, StoredHeader,
    StoredResponse, TransactionalStore, TxClaim,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, Connection, PgConnection, Postgres};
// sqlx does not re-export the trait that counts a connection's transactions.
use sqlx_core::transaction::TransactionManager;

use crate::PgStore;
use crate::claim::{Opened, Opening, SingleStep};
use crate::error::{map_err, sqlstate};
use crate::sql::{self, advance_query, lease_ms};

/// A transaction on the store's database, handed to single-step handlers. It
/// dereferences to the connection, so `&mut **tx` through the layer's `Tx`
/// extractor is an sqlx executor. Dropping it rolls back.
pub struct PgTx {
    /// Inside a transaction that sqlx counts (its depth is 1 while open), so a
    /// handler's nested `begin` is a savepoint.
    conn: PoolConnection<Postgres>,
    holds: Holds,
}

/// What a [`PgTx`] holds besides the caller's writes.
enum Holds {
    /// A phase transaction ([`TransactionalStore::begin_fenced`]).
    Phase,
    /// A single-step claim that moved an existing record (takeover, reuse):
    /// completed by an update riding with the `COMMIT`.
    MovedClaim,
    /// A single-step claim of an absent key, holding its advisory lock: the
    /// record is inserted, completed, with the `COMMIT`.
    Pending(Box<PendingInsert>),
}

/// The claim half of a single-step record not yet written.
struct PendingInsert {
    /// The store's clock when the claim read the key absent; `None` when the
    /// opening's check found it absent (the record is created at commit).
    created_at: Option<i64>,
    lease_ms: i64,
    /// The request's columns as SQL literals (`sql::request_literals`).
    request: String,
}

/// The token a single-step claim of an absent key hands its holder. The record
/// does not exist until it is written, completed, at commit, and its fencing
/// token is drawn from the store's sequence then; until that commit the key's
/// advisory lock, not a token, keeps other single-step claims out.
pub const PROVISIONAL_TOKEN: FencingToken = FencingToken(0);

/// How long an explicit rollback may take before its connection is closed
/// instead (which rolls back too, when the server notices).
const ROLLBACK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl PgTx {
    /// Commits the transaction.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        PgTransactionManager::commit(&mut self.conn).await
    }

    /// Rolls the transaction back now, releasing the key's lock before this
    /// returns (dropping it rolls back on the connection's next round trip).
    /// Savepoints a handler left open are rolled back with it. A rollback that
    /// fails, or takes longer than a second (a database gone away
    /// mid-request), closes the connection, which rolls back, and returns
    /// the error: the transaction is rolled back either way; an `Err` says
    /// the database did not confirm it (as [`SqliteTx::rollback`]'s does).
    ///
    /// [`SqliteTx::rollback`]: https://docs.rs/idemkit-sqlite/latest/idemkit_sqlite/struct.SqliteTx.html#method.rollback
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        let conn = &mut self.conn;
        let rollback = async {
            if PgTransactionManager::get_transaction_depth(conn) == 0 {
                // A rollback already queued (a handler's nested transaction
                // dropped mid-statement rolls back everything): send it.
                return conn.ping().await;
            }
            // One level per call: savepoints first, the transaction last.
            while PgTransactionManager::get_transaction_depth(conn) > 0 {
                PgTransactionManager::rollback(conn).await?;
            }
            Ok(())
        };
        let outcome = match tokio::time::timeout(ROLLBACK_WAIT, rollback).await {
            Ok(outcome) => outcome,
            Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to the rollback within {ROLLBACK_WAIT:?}"),
            ))),
        };
        if outcome.is_err() {
            self.conn.close_on_drop();
        }
        outcome
    }
}

impl Drop for PgTx {
    /// Rolls back a transaction still open: the `ROLLBACK` is queued and rides
    /// on the connection's next round trip (the pool's release check).
    fn drop(&mut self) {
        PgTransactionManager::start_rollback(&mut self.conn);
    }
}

impl Deref for PgTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl std::fmt::Debug for PgTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgTx { .. }")
    }
}

#[async_trait]
impl TransactionalStore for PgStore {
    type Tx = PgTx;

    /// The claim runs inside the transaction it returns, which begins holding
    /// the key's advisory lock (a concurrent holder makes the answer "in
    /// progress", at once or after the configured wait) and, for a first
    /// attempt, checks in the same round trip that the key has no record. A
    /// key without one is written, completed, with the `COMMIT`, on a token
    /// drawn then ([`PROVISIONAL_TOKEN`] until then). A key with a record is
    /// read: a replay, conflict or in-progress answer needs no transaction; a
    /// record to take over or reuse is moved under the lock.
    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<PgTx>> {
        self.retrying(|| async {
            let (conn, absent) = match self.open_single_step(req).await? {
                Opened::Settled(outcome) => return Ok(TxClaim::Other(outcome)),
                Opened::Absent(conn) => (conn, true),
                Opened::Locked(conn) => (conn, false),
            };
            // Rolled back when dropped, whatever happens below; what it holds is
            // set once the claim has decided.
            let mut tx = PgTx {
                conn,
                holds: Holds::Phase,
            };
            let step = if absent {
                SingleStep::Absent { read_at: None }
            } else {
                self.claim_single_step(&mut tx, req).await?
            };
            let (holds, lease) = match step {
                SingleStep::Absent { read_at } => {
                    let lease = Lease {
                        token: PROVISIONAL_TOKEN,
                        expires_at: read_at.unwrap_or_else(|| self.clock.now()).plus(req.lease),
                        resumed_from: None,
                    };
                    let request = sql::request_literals(
                        &req.fingerprint.as_bytes()[..],
                        req.recovery_point.as_deref(),
                        &req.request,
                        &StoredHeader::encode_list(&req.request.headers)?,
                    );
                    let pending = PendingInsert {
                        // Under a test clock, the claim's time.
                        created_at: read_at.map(|t| t.0).or_else(|| self.test_now()),
                        lease_ms: lease_ms(req.lease),
                        request,
                    };
                    (Holds::Pending(Box::new(pending)), lease)
                }
                SingleStep::Moved(lease) => (Holds::MovedClaim, lease),
                SingleStep::Settled(outcome) => return Ok(TxClaim::Other(outcome)),
            };
            tx.holds = holds;
            Ok(TxClaim::Claimed { tx, lease })
        })
        .await
    }

    async fn commit(&self, tx: PgTx) -> StoreResult<()> {
        if matches!(tx.holds, Holds::Pending(_)) {
            // A single-step claim of an absent key is written when it completes.
            return Err(StoreError::Unsupported(
                "committing a single-step claim without completing it",
            ));
        }
        tx.commit().await.map_err(map_err)
    }

    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<PgTx> {
        let mut opening = Opening::new(self.pool.acquire().await.map_err(map_err)?);
        PgTransactionManager::begin(opening.conn(), None)
            .await
            .map_err(map_err)?;
        let mut tx = PgTx {
            conn: opening.keep(),
            holds: Holds::Phase,
        };
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

    /// Runs on the caller's open transaction and does not commit: the phase's
    /// business writes and its progress commit together when the caller
    /// commits ([`PgTx::commit`]) or completes ([`TransactionalStore::complete_in_tx`]).
    /// Not retried: a deadlock aborts the caller's transaction, which must be
    /// run again as a whole. A single-step claim of an absent key has no
    /// record to advance until it completes: [`StoreError::Unsupported`].
    async fn advance_in_tx(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        if matches!(tx.holds, Holds::Pending(_)) {
            return Err(StoreError::Unsupported("phases inside a single-step claim"));
        }
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

    /// `ROLLBACK` now: the key's advisory lock is free when this returns
    /// (see [`PgTx::rollback`]).
    async fn rollback_tx(&self, tx: PgTx) {
        // A failed rollback closed the connection, which rolls back.
        let _ = tx.rollback().await;
    }

    async fn complete_in_tx(
        &self,
        mut tx: PgTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        // On an error the transaction is rolled back, business writes included,
        // before this returns: one refused before anything was sent (a stale
        // token) still holds the key's lock. (A failed statement aborted its
        // transaction, which released the locks; the `ROLLBACK` ends the
        // block.) A single-step claim was never committed, so
        // nobody waits on it, and its key is ours until the commit: the
        // record's write rides with the COMMIT (one round trip).
        let done = if matches!(tx.holds, Holds::Phase) {
            // A phase transaction: the fenced completion, then the COMMIT.
            match self.complete_on(&mut tx, scope, token, response, true).await {
                Ok(()) => return tx.commit().await.map_err(map_err),
                Err(e) => Err(e.into_store()),
            }
        } else {
            self.complete_single_step(&mut tx, scope, token, response).await
        };
        if done.is_err() {
            // A failed rollback closed the connection, which rolls back.
            let _ = tx.rollback().await;
        }
        done
    }
}

impl PgStore {
    /// A single-step claim's completion, fused with its `COMMIT`.
    async fn complete_single_step(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let (schema, now) = (&self.config.schema, self.test_now());
        let statement = match &tx.holds {
            Holds::Pending(_) if token != PROVISIONAL_TOKEN => return Err(StoreError::Fenced),
            Holds::Pending(p) => sql::insert_and_commit(
                schema,
                scope,
                now,
                (p.created_at, p.lease_ms),
                &p.request,
                &sql::Answer::of(response)?,
            ),
            Holds::MovedClaim => {
                sql::complete_and_commit(schema, scope, token, now, &sql::Answer::of(response)?)
            }
            Holds::Phase => {
                return Err(StoreError::Corrupt(
                    "a phase transaction has no single-step claim".into(),
                ));
            }
        };
        match sqlx::raw_sql(AssertSqlSafe(statement)).execute(&mut **tx).await {
            Ok(_) => Ok(()),
            Err(e) if sqlstate(&e).as_deref() == Some("IK001") => Err(StoreError::Fenced),
            // The key's row appeared since the claim read it absent (a lease-mode
            // claim, which takes no advisory lock): nothing committed.
            Err(e) if sqlstate(&e).as_deref() == Some("IK002") => Err(StoreError::Conflict),
            // A serialization failure at a snapshot level (`PgConfig::single_step_isolation`):
            // the same race seen through the snapshot (the key's row committed
            // since it was taken), or another transaction's conflicting writes.
            // Nothing committed either way, and the caller answers as the key
            // now answers (a replay, or a retryable "in progress").
            Err(e) if sqlstate(&e).as_deref() == Some("40001") => Err(StoreError::Conflict),
            Err(e) => Err(map_err(e)),
        }
    }
}
