//! [`KeyStore`] on PostgreSQL: each operation is one autocommitted statement
//! (retried on deadlocks and serialization failures); a holder's write is
//! fenced on its token, and the writes that end a holder's work wake waiters.

use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, FORCE_RELEASED, FencingToken, KeyStore, ListFilter, MOVED_TO_REVIEW, Millis,
    PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, ReviewEntry, Scope, StoreError, StoreResult,
    StoredHeader, StoredResponse,
};
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row};

use crate::PgStore;
use crate::claim::{Attempt, outcome_unknown};
use crate::decode::{decode_at, decode_review, fetch_record};
use crate::error::{corrupt, map_err};
use crate::retry::Retry;
use crate::sql::{self, advance_query, lease_ms, notifying};

impl PgStore {
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

    pub(crate) async fn complete_on(
        &self,
        conn: &mut PgConnection,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        notify: bool,
    ) -> Result<(), Retry> {
        let statement = if notify {
            &*sql::COMPLETE_NOTIFYING
        } else {
            &*sql::COMPLETE
        };
        let q = sqlx::query(AssertSqlSafe(statement.as_str()))
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

#[async_trait]
impl KeyStore for PgStore {
    /// A claim whose reply is lost after its write was sent (the connection
    /// failed) is settled by its attempt id (see `claim::Attempt`): the
    /// record is read again on a fresh connection, and a claim that did
    /// commit is answered `Claimed`; otherwise the error stands.
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        let attempt = Attempt::new();
        self.retrying(|| async {
            let mut conn = self.pool.acquire().await.map_err(Retry::from)?;
            match self.claim_on(&mut conn, req, &attempt).await {
                Err(e) if outcome_unknown(&e) => {
                    // Broken, or in an unknown state: never back to the pool.
                    conn.close_on_drop();
                    drop(conn);
                    match self.recover_claim(req, &attempt).await {
                        Some(lease) => Ok(ClaimOutcome::Claimed(lease)),
                        None => Err(e),
                    }
                }
                settled => settled,
            }
        })
        .await
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        self.retrying(|| async {
            let row = sqlx::query(AssertSqlSafe(sql::HEARTBEAT.as_str()))
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
        let now = self.test_now();
        self.fenced(&sql::RELEASE, true, scope, token, move |q| {
            q.bind(now).bind(RELEASE_REFUSED)
        })
        .await
    }

    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.fenced(&sql::RELEASE_DISCARDING, true, scope, token, |q| q)
            .await
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let now = self.test_now();
        self.fenced(&sql::ABANDON, true, scope, token, move |q| {
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
        let now = self.test_now();
        self.fenced(&sql::PARK, true, scope, token, move |q| {
            q.bind(now).bind(reason.to_owned())
        })
        .await
    }

    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        let rows = sqlx::query(AssertSqlSafe(sql::SELECT_ABANDONED.as_str()))
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
            let row = sqlx::query(AssertSqlSafe(sql::REAP.as_str()))
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
        let rows = sqlx::query(sql::SELECT_REVIEW)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.iter().map(decode_review).collect()
    }

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        let rows = sqlx::query(sql::SELECT_LIST)
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
        let sql = notifying(&sql::FORCE_RELEASE);
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
        let now = self.test_now();
        self.retrying(|| async {
            let changed: i64 = sqlx::query(AssertSqlSafe(sql::DISCARD.as_str()))
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
        self.wait_on(scope, timeout).await
    }
}
