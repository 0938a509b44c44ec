//! `LISTEN/NOTIFY`: one listener connection per store feeds a broadcast
//! channel; a waiter flags the record (`has_waiters`) so that its next change
//! notifies (see [`crate::sql::notifying`]), then waits for its scope.

use std::time::Duration;

use idemkit_core::{Scope, StoreResult};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::broadcast;

use crate::error::map_err;
use crate::{PgStore, sql};

/// The notification channel waiters listen on.
pub const CHANNEL: &str = "idemkit_changes";

/// The listener task, stopped when the last handle of the store goes away.
pub(crate) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(crate) async fn spawn_listener(
    pool: &PgPool,
    schema: String,
    changes: broadcast::Sender<(String, String)>,
) -> StoreResult<AbortOnDrop> {
    let mut listener = PgListener::connect_with(pool).await.map_err(map_err)?;
    listener.listen(CHANNEL).await.map_err(map_err)?;
    Ok(AbortOnDrop(tokio::spawn(async move {
        loop {
            match listener.recv().await {
                Ok(n) => {
                    if let Ok((s, account, key)) =
                        serde_json::from_str::<(String, String, String)>(n.payload())
                        && s == schema
                    {
                        let _ = changes.send((account, key));
                    }
                }
                Err(e) => {
                    // PgListener reconnects on the next recv; waiters are bounded
                    // by their own timeouts meanwhile.
                    tracing::warn!(error = %e, "idemkit-postgres: notification listener error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    })))
}

impl PgStore {
    /// [`idemkit_core::KeyStore::wait_for_change`].
    pub(crate) async fn wait_on(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        // Subscribe first, then flag the record, so a completion that lands in
        // between is either seen by the caller's next claim or notified to us.
        let mut rx = self.changes.subscribe();
        let flagged = sqlx::query(sql::FLAG_WAITERS)
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .execute(&self.pool)
            .await
            .map_err(map_err)?
            .rows_affected();
        if flagged == 0 {
            // Either another waiter flagged it (a notification will come), or the
            // record left `in_flight` before our flag (between the caller's claim
            // and now): that change sent no notification, so look once more.
            let in_flight: Option<bool> = sqlx::query_scalar(sql::IS_IN_FLIGHT)
                .bind(scope.account.as_str())
                .bind(scope.key.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(map_err)?;
            if in_flight != Some(true) {
                return Ok(());
            }
        }
        let want = (scope.account.as_str(), scope.key.as_str());
        let wait = async {
            loop {
                match rx.recv().await {
                    Ok((account, key)) if (account.as_str(), key.as_str()) == want => return,
                    Ok(_) => {}
                    // Missed some: one of them may have been ours.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        };
        let _ = tokio::time::timeout(timeout, wait).await;
        Ok(())
    }
}
