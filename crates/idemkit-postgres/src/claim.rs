//! The claim algorithm on PostgreSQL, one algorithm for both modes. One
//! statement inserts the in-flight row or returns the existing record with the
//! store's clock; the decision on an existing record is shared by every store
//! (`Resolution::of`); a takeover or window reuse is a compare-and-swap on the
//! record exactly as read (token, state and lease), on a fresh token. Lease mode
//! runs it autocommitted; single-step mode inside the handler's transaction,
//! whose `lock_timeout` bounds the wait on a concurrent uncommitted claim.

use std::time::Duration;

use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, Lease, Millis, Record, Resolution, Scope, StoredHeader,
};
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row};

use crate::PgStore;
use crate::decode::decode_at;
use crate::error::corrupt;
use crate::retry::Retry;
use crate::sql::{self, lease_ms};

impl PgStore {
    /// Reads the record and the store's clock in one statement.
    async fn fetch_with_now(
        &self,
        conn: &mut PgConnection,
        scope: &Scope,
    ) -> Result<(Millis, Option<Record>), Retry> {
        let row = sqlx::query(AssertSqlSafe(sql::SELECT_WITH_NOW.as_str()))
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

    /// Begins a transaction whose `lock_timeout` bounds the wait on a concurrent
    /// claim: the configured reject timeout, or the request's own wait.
    pub(crate) async fn begin_claim(
        &self,
        lock_wait: Duration,
    ) -> Result<sqlx::Transaction<'static, Postgres>, Retry> {
        let ms = if lock_wait.is_zero() {
            self.config.reject_lock_timeout
        } else {
            lock_wait
        }
        .as_millis()
        .max(1);
        // One round trip: the simple-query protocol runs both statements.
        let begin = AssertSqlSafe(sql::begin_with_lock_timeout(ms));
        self.pool.begin_with(begin).await.map_err(Retry::from)
    }

    /// Claims on `conn`: autocommitted (lease mode), or inside the handler's
    /// transaction (`in_tx`, single-step mode: the inserted row stays invisible
    /// and locked until that transaction commits, and the claim's short
    /// `lock_timeout` is lifted for the handler's own statements in the same
    /// statement). One round trip when the key is absent or settled (replay,
    /// in progress, mismatch); a takeover or window reuse adds the
    /// compare-and-swap.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
        in_tx: bool,
    ) -> Result<ClaimOutcome, Retry> {
        let headers = StoredHeader::encode_list(&req.request.headers)?;
        let statement = if in_tx { &*sql::CLAIM_IN_TX } else { &*sql::CLAIM };
        let row = sqlx::query(AssertSqlSafe(statement.as_str()))
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
            .bind(req.recovery_point.as_deref())
            .fetch_one(&mut *conn)
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
            let (fresh_now, fresh) = self.fetch_with_now(&mut *conn, &req.scope).await?;
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
            .move_claim(&mut *conn, req, &existing, now, takeover, in_tx)
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
    async fn move_claim(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
        seen: &Record,
        now: Millis,
        takeover: bool,
        lift_lock_timeout: bool,
    ) -> Result<Option<Lease>, Retry> {
        let expires = now.plus(req.lease);
        let moved = sqlx::query(AssertSqlSafe(sql::MOVE.as_str()))
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
            .bind(req.recovery_point.as_deref())
            .fetch_optional(conn)
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
}
