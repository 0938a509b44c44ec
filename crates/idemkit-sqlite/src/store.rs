//! [`KeyStore`] on SQLite: a write that is one statement runs autocommitted
//! (atomic on its own), a longer one in a `BEGIN IMMEDIATE` transaction; both
//! hold the in-process writer slot. A holder's write is fenced on its token
//! (zero rows changed = stale token).

use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Decision, FORCE_RELEASED, FencingToken, KeyStore, Lease, ListFilter,
    MOVED_TO_REVIEW, Millis, PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, ReviewEntry, Scope,
    StoreError, StoreResult, StoredHeader, StoredResponse,
};
use sqlx::{AssertSqlSafe, Sqlite, SqliteConnection};

use crate::SqliteStore;
use crate::decode::{decode_at, decode_review, fetch_record};
use crate::error::map_err;
use crate::sql;

impl SqliteStore {
    /// Runs a fenced single-row update; zero rows means the token is stale.
    pub(crate) async fn fenced_update(
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

    pub(crate) async fn complete_on(
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
        self.fenced_update(conn, sql::COMPLETE, scope, token, move |q| {
            q.bind(now).bind(status).bind(headers).bind(body)
        })
        .await
    }

    /// Saves a phase's progress (fenced). A step output is merged into the JSON
    /// object in Rust: SQLite's JSON paths cannot address every key (a `"` in a
    /// step name), and `json_patch` would merge nested objects instead of
    /// replacing the output. The read and the write share the transaction's
    /// write lock, so no other writer can interleave.
    pub(crate) async fn advance_on(
        &self,
        conn: &mut SqliteConnection,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        let outputs = match &update.step {
            None => None,
            Some((name, value)) => {
                let current: Option<String> = sqlx::query_scalar(sql::SELECT_STEP_OUTPUTS)
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
        self.fenced_update(conn, sql::ADVANCE, scope, token, move |q| {
            q.bind(point).bind(outputs)
        })
        .await
    }

    /// [`KeyStore::discard_progress`] in one statement.
    async fn discard_on(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.clock.now().0;
        let mut conn = self.solo().await?;
        let changed = sqlx::query(sql::DISCARD)
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .bind(now)
            .bind(FORCE_RELEASED)
            .execute(&mut *conn)
            .await
            .map_err(map_err)?
            .rows_affected();
        Ok(changed == 1)
    }
}

impl SqliteStore {
    /// The lease-mode claim, writing `attempt` with it. `wrote` is set once a
    /// claim write has gone out (`Some(takeover)`): from then on an error may
    /// hide a write that committed.
    async fn claim_as(
        &self,
        req: &ClaimRequest,
        attempt: &str,
        wrote: &mut Option<bool>,
    ) -> StoreResult<ClaimOutcome> {
        if self.assume_absent(req) {
            // No row this process knows of: the insert alone, autocommitted, is
            // the claim, without the read that would only find the key absent.
            // A row written by another process makes it insert nothing, and the
            // read below decides on it.
            let mut conn = self.solo_for_claim().await?;
            *wrote = Some(false);
            if let Some(lease) = self.insert_claim(&mut conn, req, attempt).await? {
                reply_lost(&req.scope)?;
                return Ok(ClaimOutcome::Claimed(lease));
            }
        }
        let (existing, decision) = self.read_decision(req).await?;
        if let Some(outcome) = decision.settle(existing)? {
            return Ok(outcome);
        }
        if decision == Decision::Insert {
            // Read as absent: the insert alone, autocommitted, is the claim.
            // A key that appeared meanwhile makes it insert nothing, and the
            // transaction below decides on the row it finds.
            let mut conn = self.solo_for_claim().await?;
            *wrote = Some(false);
            if let Some(lease) = self.insert_claim(&mut conn, req, attempt).await? {
                reply_lost(&req.scope)?;
                return Ok(ClaimOutcome::Claimed(lease));
            }
        }
        let mut tx = self.begin_for_claim().await?;
        match self.claim_on(&mut tx, req, attempt, wrote).await? {
            Ok(lease) => {
                tx.commit().await.map_err(map_err)?;
                reply_lost(&req.scope)?;
                Ok(ClaimOutcome::Claimed(lease))
            }
            Err(outcome) => Ok(outcome),
        }
    }

    /// A claim whose write went out but whose answer is an error: the write
    /// may have committed all the same (the behaviour contract, `docs/spec.md` §3: a lost claim reply never
    /// holds a key with no holder). The record is read back; carrying this
    /// claim's attempt id, in flight, it is this claim's and the lease is
    /// answered. Otherwise (or when the read fails too) the error stands:
    /// nothing of this claim holds the key.
    async fn claimed_after_all(
        &self,
        req: &ClaimRequest,
        attempt: &str,
        takeover: bool,
        error: StoreError,
    ) -> StoreResult<ClaimOutcome> {
        let row = sqlx::query_as::<_, (i64, i64, Option<String>)>(sql::SELECT_CLAIM_ATTEMPT)
            .bind(req.scope.account.as_str())
            .bind(req.scope.key.as_str())
            .bind(attempt)
            .fetch_optional(&self.pool)
            .await;
        match row {
            Ok(Some((token, expires_at, recovery_point))) => {
                tracing::debug!(error = %error, "idempotency: a claim's reply was lost; the record read back is the claim's");
                self.known.add(&req.scope);
                Ok(ClaimOutcome::Claimed(Lease {
                    token: FencingToken(token),
                    expires_at: Millis(expires_at),
                    // A takeover resumes from where the record is (the claim
                    // kept its recovery point); a new request from nothing.
                    resumed_from: if takeover { recovery_point } else { None },
                }))
            }
            _ => Err(error),
        }
    }
}

/// Test hook (`failpoints` feature): the failpoint
/// `idemkit_sqlite::claim_reply_lost`, configured `return(<key>)`, makes the
/// claim of that key answer an error after its write committed, as a lost
/// reply does.
fn reply_lost(scope: &Scope) -> StoreResult<()> {
    #[cfg(feature = "failpoints")]
    if fail::eval("idemkit_sqlite::claim_reply_lost", |arg| {
        arg.as_deref() == Some(scope.key.as_str())
    }) == Some(true)
    {
        return Err(StoreError::Unavailable(
            "failpoint: the claim's reply was lost after its commit".into(),
        ));
    }
    let _ = scope;
    Ok(())
}

#[async_trait]
impl KeyStore for SqliteStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        // The attempt id this claim writes into the record, so a claim that
        // cannot tell whether its write committed can recognise it.
        let attempt = uuid::Uuid::new_v4().simple().to_string();
        let mut wrote = None;
        match self.claim_as(req, &attempt, &mut wrote).await {
            Err(error) => match wrote {
                Some(takeover) => self.claimed_after_all(req, &attempt, takeover, error).await,
                None => Err(error),
            },
            answered => answered,
        }
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        let expires = self.clock.now().plus(lease);
        let mut conn = self.solo().await?;
        self.fenced_update(&mut conn, sql::HEARTBEAT, scope, token, move |q| {
            q.bind(expires.0)
        })
        .await?;
        Ok(expires)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let mut conn = self.solo().await?;
        self.complete_on(&mut conn, scope, token, response).await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        // The row stays (state `released`, behaving as absent) so the next claim's
        // token is higher than any this record ever handed out.
        // A record with recorded progress is abandoned instead (see the trait).
        let now = self.clock.now().0;
        let mut conn = self.solo().await?;
        self.fenced_update(&mut conn, sql::RELEASE, scope, token, move |q| {
            q.bind(now).bind(RELEASE_REFUSED)
        })
        .await
    }

    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        let mut conn = self.solo().await?;
        self.fenced_update(&mut conn, sql::RELEASE_DISCARDING, scope, token, |q| q)
            .await
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let now = self.clock.now().0;
        let error = error.to_owned();
        let mut conn = self.solo().await?;
        self.fenced_update(&mut conn, sql::ABANDON, scope, token, move |q| {
            q.bind(now).bind(error)
        })
        .await
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        fetch_record(&mut conn, scope).await
    }

    fn now(&self) -> Millis {
        self.clock.now()
    }

    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        if update.step.is_none() {
            // Only the recovery point: one statement.
            let mut conn = self.solo().await?;
            return self.advance_on(&mut conn, scope, token, update).await;
        }
        let mut tx = self.begin().await?;
        self.advance_on(&mut tx, scope, token, update).await?;
        tx.commit().await.map_err(map_err)
    }

    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        let now = self.clock.now().0;
        let reason = reason.to_owned();
        let mut conn = self.solo().await?;
        self.fenced_update(&mut conn, sql::PARK, scope, token, move |q| {
            q.bind(now).bind(reason)
        })
        .await
    }

    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        let rows = sqlx::query(sql::SELECT_ABANDONED)
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
        let moved = sqlx::query(AssertSqlSafe(sql::REAP_REVIEW.as_str()))
            .bind(before.0)
            .bind(now)
            .bind(MOVED_TO_REVIEW)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?
            .rows_affected();
        let parked = sqlx::query(AssertSqlSafe(sql::REAP_PARK.as_str()))
            .bind(before.0)
            .bind(now)
            .bind(MOVED_TO_REVIEW)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?
            .rows_affected();
        // One predicate selects both, so this holds by construction; kept as
        // a guard against a future edit of either statement.
        if parked != moved {
            return Err(StoreError::Corrupt(format!(
                "reaper listed {moved} records for review but parked {parked}"
            )));
        }
        // The floor is raised first, in the same transaction, so no later claim
        // of a deleted key reuses one of its tokens.
        sqlx::query(AssertSqlSafe(sql::REAP_RAISE_FLOOR.as_str()))
            .bind(before.0)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        let deleted: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(sql::REAP_DELETE.as_str()))
            .bind(before.0)
            .fetch_all(&mut *tx)
            .await
            .map_err(map_err)?;
        // Forgotten while this process's writer slot is held, so no claim of
        // this process can write one of these keys again in between.
        self.known
            .forget(deleted.iter().map(|(a, k)| (a.as_str(), k.as_str())));
        tx.commit().await.map_err(map_err)?;
        let deleted = deleted.len() as u64;
        Ok(ReapReport {
            deleted,
            moved_to_review: moved,
        })
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

    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        self.discard_on(scope).await
    }

    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.clock.now().0;
        let mut conn = self.solo().await?;
        let changed = sqlx::query(sql::FORCE_RELEASE)
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .bind(now)
            .bind(FORCE_RELEASED)
            .execute(&mut *conn)
            .await
            .map_err(map_err)?
            .rows_affected();
        Ok(changed == 1)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use idemkit_core::{KeyStore, TransactionalStore, TxClaim};
    use idemkit_testkit::ManualClock;
    use idemkit_testkit::suite::{claim_req, must_claim, response, scope};

    use crate::SqliteStore;

    /// An empty directory of this process for one test.
    fn fresh_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("idemkit-sqlite-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A store whose runtime ends before its load ran says so instead of
    /// making `keys_loaded` wait forever; its claims keep reading first.
    #[test]
    fn a_load_dropped_with_its_runtime_ends() {
        let dir = fresh_dir("dropped-load");
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // The load task is spawned as `connect` returns and never polled: a
        // current-thread runtime runs spawned tasks only inside `block_on`.
        let store = first.block_on(SqliteStore::connect(dir.join("keys.db"))).unwrap();
        drop(first);
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let loaded = second.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(10), store.keys_loaded())
                .await
                .expect("keys_loaded returns")
        });
        assert!(!loaded);
        assert!(
            store.known.may_exist(&scope("a", "any")),
            "every key is read first"
        );
    }

    /// Every key written is known, a store opened on existing keys loads
    /// them, and the reaper's deletions are forgotten (the set does not grow
    /// for as long as the process runs).
    #[tokio::test]
    async fn the_known_keys_follow_writes_loads_and_the_reaper() {
        let dir = fresh_dir("known");
        let clock = Arc::new(ManualClock::new());
        let store = SqliteStore::connect(dir.join("keys.db"))
            .await
            .unwrap()
            .with_clock(clock.clone());
        assert_eq!(store.known.loaded_len().await, 0);
        let lease_mode = scope("a", "lease-mode");
        let held = must_claim(&store, &claim_req(&lease_mode, "{}")).await;
        store
            .complete(&lease_mode, held.token, &response(201, "one"))
            .await
            .unwrap();
        let single = scope("a", "single-step");
        let TxClaim::Claimed { tx, lease } = store.claim_in_tx(&claim_req(&single, "{}")).await.unwrap()
        else {
            panic!("claims")
        };
        store
            .complete_in_tx(tx, &single, lease.token, &response(201, "two"))
            .await
            .unwrap();
        assert_eq!(store.known.loaded_len().await, 2);
        let reopened = SqliteStore::connect(dir.join("keys.db")).await.unwrap();
        assert_eq!(reopened.known.loaded_len().await, 2, "loaded at open");
        assert!(reopened.known.may_exist(&single));
        assert!(!reopened.known.may_exist(&scope("a", "never-written")));
        clock.advance(std::time::Duration::from_secs(3600));
        let report = store.reap(store.now()).await.unwrap();
        assert_eq!(report.deleted, 2);
        assert_eq!(store.known.loaded_len().await, 0, "reaped keys are forgotten");
    }
}
