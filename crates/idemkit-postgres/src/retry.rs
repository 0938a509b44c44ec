//! Deadlocks and serialization failures are retried inside the store a bounded
//! number of times; every other failure is final.

use std::future::Future;
use std::time::Duration;

use idemkit_core::{StoreError, StoreResult};

use crate::PgStore;
use crate::error::{map_err, sqlstate};

/// An operation's failure: retry it (deadlock, serialization failure) or not.
#[derive(Debug)]
pub(crate) enum Retry {
    Transient(sqlx::Error),
    Fatal(StoreError),
}

impl Retry {
    pub(crate) fn into_store(self) -> StoreError {
        match self {
            Self::Transient(e) => StoreError::Unavailable(Box::new(e)),
            Self::Fatal(e) => e,
        }
    }
}

impl From<sqlx::Error> for Retry {
    fn from(e: sqlx::Error) -> Self {
        match sqlstate(&e).as_deref() {
            Some("40001" | "40P01") => Self::Transient(e),
            _ => Self::Fatal(map_err(e)),
        }
    }
}

impl From<StoreError> for Retry {
    fn from(e: StoreError) -> Self {
        Self::Fatal(e)
    }
}

impl PgStore {
    /// Runs `op`, retrying deadlocks and serialization failures a bounded number
    /// of times with a short jittered pause.
    pub(crate) async fn retrying<T, F, Fut>(&self, mut op: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Retry>>,
    {
        let mut attempt = 1;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(Retry::Transient(e)) if attempt < self.config.max_attempts => {
                    tracing::debug!(error = %e, attempt, "idemkit-postgres: retrying after a transient conflict");
                    let pause = 5u64 << attempt;
                    let backoff = Duration::from_millis(pause / 2 + pause * u64::from(attempt % 2) / 2);
                    self.backoff(backoff).await;
                    attempt += 1;
                }
                Err(Retry::Transient(e)) => return Err(StoreError::Unavailable(Box::new(e))),
                Err(Retry::Fatal(e)) => return Err(e),
            }
        }
    }
}
