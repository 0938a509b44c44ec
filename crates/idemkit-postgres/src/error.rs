//! sqlx errors normalised to [`StoreError`] kinds.

use idemkit_core::StoreError;

pub(crate) fn corrupt(e: sqlx::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// Normalises sqlx errors: connection loss, pool exhaustion, timeouts, server
/// shutdown and resource exhaustion are `Unavailable` (a retryable 503), as is a
/// lock wait that timed out; everything else is `Backend`.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    let unavailable = match &e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("57")
                || c == "55P03"
                || c == "40001"
                || c == "40P01"
        }),
        _ => false,
    };
    if unavailable {
        StoreError::Unavailable(Box::new(e))
    } else {
        StoreError::Backend(Box::new(e))
    }
}

pub(crate) fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// A lock wait that ran out (SQLSTATE 55P03).
pub(crate) fn is_lock_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<sqlx::Error>().and_then(sqlstate).as_deref() == Some("55P03")
}
