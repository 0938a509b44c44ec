//! The claim algorithm on SQLite. A claim of a key this process knows to have
//! a row (`known`) first reads the record without the write lock and decides
//! (`ClaimRequest::decide`, shared by every store); only when the decision
//! needs a write does it take the lock, insert, or move the record it re-reads
//! under the lock by a compare-and-swap on its token. A claim of any other key
//! skips the read: its insert arbitrates on the primary key.

use idemkit_core::{
    ClaimOutcome, ClaimRequest, Decision, FencingToken, Lease, Record, RecordHead, Resolution, Scope,
    StoreError, StoreResult, StoredHeader, StoredResponse,
};
use sqlx::{Row, SqliteConnection};

use crate::SqliteStore;
use crate::decode::fetch_record;
use crate::error::{cas_ok, corrupt, map_err};
use crate::sql;
use crate::tx::{PendingClaim, SqliteTx};

impl SqliteStore {
    /// Claims inside `tx`. Returns the lease when claimed, or the outcome to answer.
    /// `attempt` is the claim's attempt id, written with it; `wrote` is set
    /// (`Some(takeover)`) before each claim write goes out.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest,
        attempt: &str,
        wrote: &mut Option<bool>,
    ) -> StoreResult<Result<Lease, ClaimOutcome>> {
        *wrote = Some(false);
        if let Some(lease) = self.insert_claim(conn, req, attempt).await? {
            return Ok(Ok(lease));
        }
        let now = self.clock.now();
        let expires = now.plus(req.lease);
        let headers = StoredHeader::encode_list(&req.request.headers)?;
        let existing = fetch_record(&mut *conn, &req.scope).await?.ok_or_else(|| {
            StoreError::Corrupt("insert conflicted but no row was found under the write lock".into())
        })?;
        let takeover = match Resolution::of(&existing, req, now)? {
            Resolution::Move { takeover } => takeover,
            Resolution::Settled(outcome) => return Ok(Err(outcome)),
        };
        let next = FencingToken(existing.fencing_token.0 + 1);
        *wrote = Some(takeover);
        // Takeover keeps the claim's progress and request; window reuse starts clean.
        let moved = sqlx::query(sql::CLAIM_MOVE)
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
            .bind(req.recovery_point.as_deref())
            .bind(attempt)
            .execute(&mut *conn)
            .await
            .map_err(map_err)?;
        cas_ok(moved.rows_affected())?;
        let resumed_from = if takeover {
            existing.recovery_point.or_else(|| req.recovery_point.clone())
        } else {
            None
        };
        Ok(Ok(Lease {
            token: next,
            expires_at: expires,
            resumed_from,
        }))
    }

    /// Inserts the claim of an absent key, in flight; `None` when the key
    /// exists. One statement, so it is atomic outside a transaction too (the
    /// lease-mode claim of a key read as absent runs it in autocommit),
    /// carrying the claim's attempt id.
    pub(crate) async fn insert_claim(
        &self,
        conn: &mut SqliteConnection,
        req: &ClaimRequest,
        attempt: &str,
    ) -> StoreResult<Option<Lease>> {
        let now = self.clock.now();
        let expires = now.plus(req.lease);
        let inserted = sqlx::query(sql::CLAIM_INSERT)
            .bind(req.scope.account.as_str())
            .bind(req.scope.key.as_str())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(now.0)
            .bind(expires.0)
            .bind(&req.request.method)
            .bind(&req.request.path)
            .bind(StoredHeader::encode_list(&req.request.headers)?)
            .bind(&req.request.body)
            .bind(req.recovery_point.as_deref())
            .bind(attempt)
            .fetch_optional(&mut *conn)
            .await
            .map_err(map_err)?;
        // Inserted or not, the key has a row now.
        self.known.add(&req.scope);
        inserted
            .map(|row| {
                Ok(Lease {
                    token: FencingToken(row.try_get(0).map_err(corrupt)?),
                    expires_at: expires,
                    resumed_from: None,
                })
            })
            .transpose()
    }

    /// Whether a claim may skip its read: a new request (not a resume of a
    /// record it saw) for a key with no row this process knows of (see
    /// `known`). Its write then arbitrates on the primary key.
    pub(crate) fn assume_absent(&self, req: &ClaimRequest) -> bool {
        req.resume.is_none() && !self.known.may_exist(&req.scope)
    }

    /// Reads the record with a plain read (no write lock) and decides. A
    /// completed record within its window is immutable and an in-flight one with
    /// a live lease is in progress at the moment it was read, so those answers
    /// need no lock; the others are confirmed by the atomic write that follows.
    pub(crate) async fn read_decision(&self, req: &ClaimRequest) -> StoreResult<(Option<Record>, Decision)> {
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        let existing = fetch_record(&mut conn, &req.scope).await?;
        if existing.is_some() {
            self.known.add(&req.scope);
        }
        let decision = req.decide(existing.as_ref().map(RecordHead::from).as_ref(), self.clock.now());
        Ok((existing, decision))
    }

    /// Writes a pending single-step claim as a completed record and commits.
    /// The primary key (INSERT) or the token compare-and-swap (UPDATE)
    /// arbitrates: a miss means another request with this key committed first
    /// → [`StoreError::Conflict`], and nothing commits. An absent key's insert
    /// and the `COMMIT` go in one call ([`sql::INSERT_COMPLETED_AND_COMMIT`]).
    pub(crate) async fn complete_pending_claim(
        &self,
        mut tx: SqliteTx,
        scope: &Scope,
        token: FencingToken,
        p: PendingClaim,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        if p.token != token {
            return Err(StoreError::Fenced);
        }
        let now = self.clock.now();
        let statement = match p.replaces {
            None => sql::INSERT_COMPLETED_AND_COMMIT,
            Some(_) => sql::REPLACE_COMPLETED,
        };
        let query = sqlx::query(statement)
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
            .bind(&response.body);
        let Some(seen) = p.replaces else {
            let inserted = tx.finish_with(query).await;
            let taken = matches!(&inserted, Err(sqlx::Error::Database(db))
                if db.kind() == sqlx::error::ErrorKind::UniqueViolation);
            if inserted.is_ok() || taken {
                // Inserted, or another process's row was there first: the key
                // has a row, and the retry of this claim reads it.
                self.known.add(scope);
            }
            return match inserted {
                Ok(_) => Ok(()),
                Err(_) if taken => Err(StoreError::Conflict),
                Err(e) => Err(map_err(e)),
            };
        };
        let done = query
            .bind(seen.fencing_token.0)
            .bind(p.keep_progress)
            .bind(seen.state.as_str())
            .bind(seen.lease_expires_at.0)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        if done.rows_affected() != 1 {
            return Err(StoreError::Conflict);
        }
        tx.commit().await.map_err(map_err)
    }
}
