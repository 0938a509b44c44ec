//! sqlx errors normalised to [`StoreError`] kinds.

use idemkit_core::{StoreError, StoreResult};

/// Checks a compare-and-swap made under the write lock.
pub(crate) fn cas_ok(rows: u64) -> StoreResult<()> {
    // Under the write lock the row cannot change between the read and the update;
    // a miss means something outside this store wrote to the table.
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::Corrupt("record changed under the write lock".into()))
    }
}

pub(crate) fn corrupt(e: sqlx::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

pub(crate) fn backend(e: sqlx::Error) -> StoreError {
    StoreError::Backend(Box::new(e))
}

/// Normalises sqlx errors: lock contention, pool exhaustion and I/O are
/// `Unavailable` (a retryable 503); everything else is `Backend`.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
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
