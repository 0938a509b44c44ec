//! The claim algorithm on PostgreSQL. Lease mode: one autocommitted statement
//! inserts the in-flight row or returns the existing record with the store's
//! clock. Single-step mode, inside the handler's transaction: the round trip
//! that opens it takes the key's advisory lock (a try-lock, or a wait bounded
//! by the claim's `lock_timeout`) and checks that the key has no record; a key without one
//! is written with the `COMMIT`, so a first request costs no round trip of its
//! own. A key with a record is read, and decided as every store decides
//! (`Resolution::of`); a takeover or window reuse is a compare-and-swap on the
//! record exactly as read (token, state and lease), on a fresh token, under
//! the lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, Lease, Millis, Record, Resolution, Scope, StoreError,
    StoredHeader,
};
use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use crate::PgStore;
use crate::decode::decode_at;
use crate::error::{corrupt, is_lock_timeout, sqlstate};
use crate::retry::Retry;
use crate::sql::{self, lease_ms};

/// The key's advisory lock for single-step claims: the first 8 bytes of
/// SHA-256 over the account's length, the account and the key. Every instance
/// sharing a store must compute the same value for a key, so this function is
/// part of the store's format: changing it would let instances of two versions
/// run one key at once during an upgrade. A collision between two keys (one
/// in 2^64) only makes one answer "in progress" (or wait) while the other runs.
pub(crate) fn lock_id(scope: &Scope) -> i64 {
    let account = scope.account.as_str().as_bytes();
    let mut h = Sha256::new();
    h.update((account.len() as u64).to_be_bytes());
    h.update(account);
    h.update(scope.key.as_str().as_bytes());
    let digest = h.finalize();
    i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// A connection on which a transaction is being opened. sqlx counts a
/// transaction only once its `BEGIN` has answered, and its pool does not look
/// at a returned connection's transaction state; the opening round trip may wait
/// for the key's lock. So if the caller is cancelled meanwhile, or the opening
/// fails, the connection is closed (which ends its transaction and releases the
/// lock) instead of going back to the pool inside a transaction nobody owns.
pub(crate) struct Opening(Option<PoolConnection<Postgres>>);

impl Opening {
    pub(crate) fn new(conn: PoolConnection<Postgres>) -> Self {
        Self(Some(conn))
    }

    pub(crate) fn conn(&mut self) -> &mut PoolConnection<Postgres> {
        self.0.as_mut().expect("kept only once")
    }

    /// The connection, in a known state: returned to the pool when dropped.
    pub(crate) fn keep(mut self) -> PoolConnection<Postgres> {
        self.0.take().expect("kept only once")
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            conn.close_on_drop();
        }
    }
}

/// One lease-mode claim call, as its writes name it in the record
/// (`claim_attempt`, migration `20261222000001`), so that a claim whose reply
/// was lost can tell its own committed write from anybody else's.
pub(crate) struct Attempt {
    /// Random, one per [`idemkit_core::KeyStore::claim`] call (kept across the
    /// store's own retries of it).
    id: String,
    /// Whether the last write sent was a takeover's move (so a recovered lease
    /// resumes from the record's recovery point).
    takeover: AtomicBool,
    /// When the call began: a record read back after the claim's lease could
    /// have run out is not taken for ours (see [`PgStore::recover_claim`]).
    started: Instant,
}

impl Attempt {
    pub(crate) fn new() -> Self {
        Self {
            id: uuid::Uuid::new_v4().simple().to_string(),
            takeover: AtomicBool::new(false),
            started: Instant::now(),
        }
    }
}

/// Whether a failed claim may have committed all the same: the connection
/// failed (an I/O or protocol error, the connection's worker gone, a
/// connection-class SQLSTATE) after the statement may have been sent, so its
/// outcome is unknown. A database error the statement raised itself is a
/// known outcome (nothing committed), and so is a pool that handed out no
/// connection.
pub(crate) fn outcome_unknown(e: &Retry) -> bool {
    let Retry::Fatal(StoreError::Unavailable(e)) = e else {
        return false;
    };
    match e.downcast_ref::<sqlx::Error>() {
        Some(
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed | sqlx::Error::Tls(_),
        ) => true,
        Some(e @ sqlx::Error::Database(_)) => sqlstate(e).is_some_and(|c| c.starts_with("08")),
        _ => false,
    }
}

/// Failpoints `idemkit_postgres::claim::reply_lost` (the claim statement) and
/// `idemkit_postgres::claim::move_reply_lost` (a takeover's or reuse's move):
/// the statement committed, and its reply is lost, as when the connection
/// drops between the commit and the answer. The argument names the key it
/// applies to (none: every key), so tests running in parallel in one process
/// do not trip it for each other.
// Without the `failpoints` feature both branches expand to nothing.
#[cfg_attr(not(feature = "failpoints"), allow(clippy::if_same_then_else))]
fn reply_lost(moving: bool, scope: &Scope) -> Result<(), sqlx::Error> {
    let lost = |key: Option<String>| {
        if key.as_deref().is_none_or(|k| k == scope.key.as_str()) {
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "failpoint: the claim's reply was lost",
            )))
        } else {
            Ok(())
        }
    };
    // Without the `failpoints` feature the macros below expand to nothing.
    let _ = &lost;
    if moving {
        fail::fail_point!("idemkit_postgres::claim::move_reply_lost", lost);
    } else {
        fail::fail_point!("idemkit_postgres::claim::reply_lost", lost);
    }
    Ok(())
}

/// How long a single-step claim that found the key's lock held waits before
/// its one more try, when no wait is configured (see
/// [`PgStore::open_single_step`]).
const BUSY_GRACE: Duration = Duration::from_millis(20);

/// How a single-step claim's transaction opened ([`PgStore::open_single_step`]).
pub(crate) enum Opened {
    /// Holding the key's advisory lock, and the key has no record: nothing to
    /// read, the record is written, completed, at commit.
    Absent(PoolConnection<Postgres>),
    /// Holding the key's advisory lock: the record must be read
    /// ([`PgStore::claim_single_step`]).
    Locked(PoolConnection<Postgres>),
    /// Nothing to run, and no transaction: a replay, a conflict, in progress.
    Settled(ClaimOutcome),
}

/// What a single-step claim found, holding the key's advisory lock.
pub(crate) enum SingleStep {
    /// The key is absent: the record is written, completed, at commit. It was
    /// read absent at `read_at` by the store's clock, which becomes its
    /// creation time (`None`: the opening's check found it absent, and the
    /// record is created at commit).
    Absent { read_at: Option<Millis> },
    /// A record was taken over or reused (moved, uncommitted, in this transaction).
    Moved(Lease),
    /// Nothing to run: a replay, a conflict, in progress, stale.
    Settled(ClaimOutcome),
}

/// The store's clock (column 0) and the record from column 1 (`None` when its
/// columns are NULL: the key is absent), as `SELECT_WITH_NOW` and
/// `rollback_and_read` lay them out.
fn now_and_record(row: &PgRow) -> Result<(Millis, Option<Record>), Retry> {
    let now = Millis(row.try_get(0).map_err(corrupt)?);
    let existing = if row.try_get::<Option<String>, _>(1).map_err(corrupt)?.is_some() {
        Some(decode_at(row, 1)?)
    } else {
        None
    };
    Ok((now, existing))
}

impl PgStore {
    /// A lease-mode claim whose outcome is unknown ([`outcome_unknown`]):
    /// the record read again on a fresh connection. If it carries `attempt`'s
    /// id, in flight on a live lease, the claim committed and its lease is
    /// returned (so the caller runs and completes the request instead of the
    /// key waiting out a lease nobody holds). `None` otherwise, and when the
    /// read fails too (then the lease does run out: the key is free for a
    /// takeover when it does). A record read back later than a lease after
    /// the call began is not taken for ours: by then the lease could have run
    /// out and another attempt taken over on a version that does not write
    /// attempt ids.
    pub(crate) async fn recover_claim(&self, req: &ClaimRequest, attempt: &Attempt) -> Option<Lease> {
        for pause in [0, 20, 100] {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let left = req
                .lease
                .checked_sub(attempt.started.elapsed())
                .filter(|left| !left.is_zero())?;
            // Closed when dropped unless the read finished: a read that waits on
            // the row lock and is cancelled (the bound below, or the caller's
            // own) must not go back to the pool with its statement running.
            let mut conn = match self.pool.acquire().await {
                Ok(conn) => Opening::new(conn),
                Err(e) => {
                    tracing::debug!(error = %e, "idemkit-postgres: re-reading a claim whose reply was lost");
                    continue;
                }
            };
            // The read may wait behind our own cut-off statement still running
            // on the server (see `sql::CLAIMED_BY_ATTEMPT`), at most for what is
            // left of the lease: past it the record could not be ours anyway.
            let read = tokio::time::timeout(
                left,
                sqlx::query(AssertSqlSafe(sql::CLAIMED_BY_ATTEMPT.as_str()))
                    .bind(req.scope.account.as_str())
                    .bind(req.scope.key.as_str())
                    .bind(attempt.id.as_str())
                    .bind(self.test_now())
                    .fetch_optional(&mut **conn.conn()),
            )
            .await;
            let read = match read {
                Ok(read) => read,
                // Cancelled mid-statement: `conn` closes.
                Err(_) => return None,
            };
            if read.is_ok() {
                drop(conn.keep());
            }
            let row = match read {
                Ok(Some(row)) => row,
                Ok(None) => return None,
                Err(e) => {
                    tracing::debug!(error = %e, "idemkit-postgres: re-reading a claim whose reply was lost");
                    continue;
                }
            };
            if !row.try_get::<bool, _>(3).unwrap_or(false) {
                return None;
            }
            let lease = (|| -> Result<Lease, sqlx::Error> {
                Ok(Lease {
                    token: FencingToken(row.try_get(0)?),
                    expires_at: Millis(row.try_get(1)?),
                    resumed_from: if attempt.takeover.load(Ordering::Relaxed) {
                        row.try_get(2)?
                    } else {
                        None
                    },
                })
            })();
            return lease.ok();
        }
        None
    }

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
        match row {
            Some(row) => now_and_record(&row),
            None => Ok((self.clock.now(), None)),
        }
    }

    /// Opens a single-step claim's transaction holding the key's advisory lock
    /// ([`lock_id`]). A concurrent holder makes the answer "in progress" (the
    /// aborted transaction is rolled back): at once by default, or once the
    /// request's own wait, or the configured reject timeout, has run out.
    ///
    /// A first attempt (no resume) of a key this process has not claimed lately
    /// (`recent`) also checks, in the same round trip, that the key has no
    /// record ([`sql::begin_locked_absent`]): then the claim needs no read, and
    /// a first request sends nothing but the handler's own round trips. A key
    /// with a record fails the check; its transaction is rolled back and the
    /// record read in one round trip, which settles a replay, a conflict or an
    /// in-progress answer without a transaction. A key claimed here lately
    /// (likely a retry) or a resume is read first, outside a transaction, and
    /// settled the same way. Only a record to move (a takeover, a window
    /// reuse, a released key), or a key read absent, opens the transaction
    /// holding the lock and reads again under it.
    pub(crate) async fn open_single_step(&self, req: &ClaimRequest) -> Result<Opened, Retry> {
        let wait = if req.lock_wait.is_zero() {
            self.config.reject_lock_timeout
        } else {
            req.lock_wait
        };
        // No wait: a try-lock. (A `lock_timeout` of zero would mean no bound,
        // hence the floor of 1 ms.)
        let wait_ms = (!wait.is_zero()).then(|| wait.as_millis().max(1));
        let lock = lock_id(&req.scope);
        // A key claimed here before is likely a retry: read it (see `recent`).
        let seen = self.recent.contains(lock);
        self.recent.remember(lock);
        let mut opened = self.open_once(req, wait_ms, lock, seen).await?;
        if opened.is_none() && wait_ms.is_none() {
            // The lock may be held by a transaction that is over but whose
            // rollback has not reached the server yet: the engine rolls back
            // through `rollback_tx` before answering, but a transaction
            // dropped instead (a panic, a cancelled caller) leaves its
            // `ROLLBACK` to its connection's release to the pool. One more try
            // after a short grace tells that from a live holder.
            tokio::time::sleep(BUSY_GRACE).await;
            opened = self.open_once(req, wait_ms, lock, seen).await?;
        }
        Ok(opened.unwrap_or(Opened::Settled(ClaimOutcome::InProgress {
            retry_after: Duration::from_secs(1),
        })))
    }

    /// One try of [`Self::open_single_step`]; `None` when the key's lock is
    /// held (at once, or past the wait).
    async fn open_once(
        &self,
        req: &ClaimRequest,
        wait_ms: Option<u128>,
        lock: i64,
        seen: bool,
    ) -> Result<Option<Opened>, Retry> {
        let mut opening = Opening::new(self.pool.acquire().await.map_err(Retry::from)?);
        let mut check_absence = req.resume.is_none() && !seen;
        if !check_absence {
            // A retry or a resume: read first, outside any transaction. A
            // replay, a conflict or a live holder settles here, without the
            // lock; a key read absent opens as a first request does.
            let (now, existing) = self.fetch_with_now(opening.conn(), &req.scope).await?;
            match existing {
                Some(existing) => {
                    if let Resolution::Settled(outcome) = Resolution::of(&existing, req, now)? {
                        drop(opening.keep());
                        return Ok(Some(Opened::Settled(outcome)));
                    }
                }
                None => check_absence = req.resume.is_none(),
            }
        }
        if check_absence {
            if !self.lock_first(&mut opening, wait_ms, lock, &req.scope).await? {
                drop(opening.keep());
                return Ok(None);
            }
            let begin = sql::begin_locked_absent(
                self.config.single_step_isolation,
                wait_ms,
                lock,
                &self.config.schema,
                &req.scope,
            );
            match PgTransactionManager::begin(opening.conn(), Some(AssertSqlSafe(begin).into_sql_str())).await
            {
                Ok(()) => return Ok(Some(Opened::Absent(opening.keep()))),
                Err(e) if sqlstate(&e).as_deref() == Some("IK003") => {
                    // The transaction is aborted, and sqlx does not count it.
                    let read = sql::rollback_and_read(&req.scope, self.test_now());
                    let row = sqlx::raw_sql(AssertSqlSafe(read))
                        .fetch_optional(&mut **opening.conn())
                        .await
                        .map_err(Retry::from)?;
                    if let Some((now, Some(existing))) = row.as_ref().map(now_and_record).transpose()?
                        && let Resolution::Settled(outcome) = Resolution::of(&existing, req, now)?
                    {
                        drop(opening.keep());
                        return Ok(Some(Opened::Settled(outcome)));
                    }
                }
                Err(e) => return self.busy_or_fail(opening, e).await,
            }
        }
        if !self.lock_first(&mut opening, wait_ms, lock, &req.scope).await? {
            drop(opening.keep());
            return Ok(None);
        }
        let begin = AssertSqlSafe(sql::begin_locked(
            self.config.single_step_isolation,
            wait_ms,
            lock,
            &self.config.schema,
        ))
        .into_sql_str();
        match PgTransactionManager::begin(opening.conn(), Some(begin)).await {
            Ok(()) => Ok(Some(Opened::Locked(opening.keep()))),
            Err(e) => self.busy_or_fail(opening, e).await,
        }
    }

    /// Takes the key's session-level lock before a transaction at a snapshot
    /// level begins (see [`sql::begin_locked`]); `false` when another request
    /// holds it (at once, or past the wait), and nothing is open then. At
    /// READ COMMITTED the transaction takes the lock itself: nothing to do. On
    /// an error, and if the caller is cancelled before the transaction has
    /// taken the lock over, `opening` closes the connection, which frees it.
    async fn lock_first(
        &self,
        opening: &mut Opening,
        wait_ms: Option<u128>,
        lock: i64,
        scope: &Scope,
    ) -> Result<bool, Retry> {
        // Read by the failpoint below only (nothing without `failpoints`).
        let _ = scope;
        if !self.config.single_step_isolation.takes_lock_first() {
            return Ok(true);
        }
        let wait_ms = wait_ms.map(|ms| i64::try_from(ms).unwrap_or(i64::MAX));
        let taken = sqlx::query(AssertSqlSafe(sql::session_lock(&self.config.schema)))
            .bind(lock)
            .bind(wait_ms)
            .execute(&mut **opening.conn())
            .await;
        // Failpoint `idemkit_postgres::claim::after_session_lock`: the opening
        // fails between its two round trips (argument: the key it applies to).
        // Without the `failpoints` feature the closure is only `Ok(())`.
        #[cfg_attr(not(feature = "failpoints"), allow(clippy::bind_instead_of_map))]
        let taken = taken.and_then(|_| {
            fail::fail_point!("idemkit_postgres::claim::after_session_lock", |key: Option<
                String,
            >| {
                if key.as_deref().is_none_or(|k| k == scope.key.as_str()) {
                    Err(sqlx::Error::Io(std::io::Error::other(
                        "failpoint: the opening failed holding the session lock",
                    )))
                } else {
                    Ok(())
                }
            });
            Ok(())
        });
        match taken {
            Ok(_) => Ok(true),
            Err(e) if is_lock_timeout(&e) => Ok(false),
            Err(e) => Err(Retry::from(e)),
        }
    }

    /// A single-step opening that failed: `None` if the key's lock is held
    /// (at once, or past the wait; the transaction began and is aborted, and
    /// sqlx does not count it: it is rolled back here), the error otherwise
    /// (the connection is closed with `opening`).
    async fn busy_or_fail(&self, mut opening: Opening, e: sqlx::Error) -> Result<Option<Opened>, Retry> {
        if !is_lock_timeout(&e) {
            return Err(Retry::from(e));
        }
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut **opening.conn())
            .await
            .map_err(Retry::from)?;
        drop(opening.keep());
        Ok(None)
    }

    /// The lease-mode claim, autocommitted on `conn`. One round trip when the
    /// key is absent or settled (replay, in progress, mismatch); a takeover or
    /// window reuse adds the compare-and-swap.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
        attempt: &Attempt,
    ) -> Result<ClaimOutcome, Retry> {
        let headers = StoredHeader::encode_list(&req.request.headers)?;
        let row = sqlx::query(AssertSqlSafe(sql::CLAIM.as_str()))
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
            .bind(attempt.id.as_str())
            .fetch_one(&mut *conn)
            .await
            .and_then(|row| reply_lost(false, &req.scope).map(|()| row))
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
        self.test_pause("claim::before_move").await;
        attempt.takeover.store(takeover, Ordering::Relaxed);
        match self
            .move_claim(&mut *conn, req, &existing, now, takeover, Some(attempt))
            .await?
        {
            Some(lease) => Ok(ClaimOutcome::Claimed(lease)),
            // The record changed since it was read (completed by a lapsed holder,
            // heartbeaten, moved by another attempt): decide again on its new state.
            None => Err(Retry::Transient(sqlx::Error::RowNotFound)),
        }
    }

    /// The single-step claim, on a transaction opened by
    /// [`Self::open_single_step`] whose record must be read (it holds the key's
    /// advisory lock): one read of the record. A key read absent is not written
    /// now: the record is inserted, completed, with the `COMMIT`
    /// ([`SingleStep::Absent`]). A record that can be taken over or reused is
    /// moved in this transaction as in lease mode.
    pub(crate) async fn claim_single_step(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<SingleStep, Retry> {
        let (now, existing) = self.fetch_with_now(&mut *conn, &req.scope).await?;
        let Some(existing) = existing else {
            if req.resume.is_some() {
                // A resume never inserts: a record that is gone is stale.
                return Ok(SingleStep::Settled(ClaimOutcome::Stale));
            }
            return Ok(SingleStep::Absent { read_at: Some(now) });
        };
        let takeover = match Resolution::of(&existing, req, now)? {
            Resolution::Move { takeover } => takeover,
            Resolution::Settled(outcome) => return Ok(SingleStep::Settled(outcome)),
        };
        // Lease-mode actors (a heartbeat, the completer, the reaper) take no
        // advisory lock: the move is a compare-and-swap on the record as read.
        match self
            .move_claim(&mut *conn, req, &existing, now, takeover, None)
            .await?
        {
            Some(lease) => Ok(SingleStep::Moved(lease)),
            None => Err(Retry::Transient(sqlx::Error::RowNotFound)),
        }
    }

    /// Compare-and-swap of a record to a new holder, on a fresh token: takeover
    /// keeps its progress and generation, window reuse starts clean. It succeeds
    /// only if the record is still exactly as `seen` (token, state and lease): a
    /// record that completed, was heartbeaten, parked, released or moved in
    /// between is never reopened (the behaviour contract, `docs/spec.md` §3). `None` when it changed.
    async fn move_claim(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
        seen: &Record,
        now: Millis,
        takeover: bool,
        attempt: Option<&Attempt>,
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
            .bind(req.recovery_point.as_deref())
            .bind(attempt.map(|a| a.id.as_str()))
            .fetch_optional(conn)
            .await
            .and_then(|row| reply_lost(true, &req.scope).map(|()| row))
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
