//! Single-step mode: [`PgTx`] and the [`TransactionalStore`] implementation.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, PhaseUpdate, Scope, StoreError, StoreResult, StoredHeader,
    StoredResponse, TransactionalStore, TxClaim,
};
use sqlx::{AssertSqlSafe, PgConnection, Postgres};

use crate::PgStore;
use crate::error::{is_lock_timeout, map_err, sqlstate};
use crate::retry::Retry;
use crate::sql::{self, advance_query};

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

#[async_trait]
impl TransactionalStore for PgStore {
    type Tx = PgTx;

    /// The claim runs inside the transaction it returns: begin (with the
    /// claim's `lock_timeout`), then one statement that inserts the in-flight row
    /// or reads the existing record. A replay, conflict or in-progress answer
    /// drops the transaction (its rollback rides on the connection's release).
    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<PgTx>> {
        self.retrying(|| async {
            let mut tx = self.begin_claim(req.lock_wait).await?;
            match self.claim_on(&mut tx, req, true).await {
                Ok(ClaimOutcome::Claimed(lease)) => Ok(TxClaim::Claimed {
                    tx: PgTx {
                        tx,
                        single_step: true,
                    },
                    lease,
                }),
                Ok(outcome) => Ok(TxClaim::Other(outcome)),
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
        if tx.single_step {
            // Nobody waits on an uncommitted claim, and the row is ours until the
            // commit: the completion rides with the COMMIT (one round trip).
            let statement = sql::complete_and_commit(
                &self.config.schema,
                scope,
                token,
                self.test_now(),
                response.status,
                &StoredHeader::encode_list(&response.headers)?,
                &response.body,
            );
            return match sqlx::raw_sql(AssertSqlSafe(statement)).execute(&mut *tx).await {
                Ok(_) => Ok(()),
                Err(e) if sqlstate(&e).as_deref() == Some("IK001") => Err(StoreError::Fenced),
                Err(e) => Err(map_err(e)),
            };
        }
        self.complete_on(&mut tx, scope, token, response, true)
            .await
            .map_err(Retry::into_store)?;
        tx.tx.commit().await.map_err(map_err)
    }
}
