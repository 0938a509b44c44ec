//! The scopes this process knows to have a row in the key table, so a claim
//! of any other key can skip the read that would only find it absent.
//!
//! The set is a hint, never the arbiter: the table's primary key is. It holds
//! a 64-bit hash of every scope in the table when the store opened, and of
//! every scope this store has read or written a row for since, and loses the
//! ones its reaper deletes. A scope
//! missing from it is either absent or was written by another process (or
//! another store on the same file) since; a claim that skips the read then
//! meets that row at its insert, which fails on the primary key: a lease-mode
//! claim falls back to the read-and-decide path, and a single-step claim's
//! transaction (the handler's writes with it) rolls back with
//! [`StoreError::Conflict`](idemkit_core::StoreError::Conflict), after which
//! the layer answers what the key answers. A hash collision only makes a claim
//! read first, as it did before the set existed.
//!
//! Memory: about 16 bytes per record in the table. The table is loaded in
//! the background when the store opens ([`KnownKeys::spawn_load`]).

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::TryStreamExt;
use idemkit_core::{Scope, StoreResult};
use sqlx::SqlitePool;

use crate::error::map_err;

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct KnownKeys {
    hasher: std::hash::RandomState,
    set: Mutex<HashSet<u64>>,
    /// Until the table has been loaded, every key may exist.
    loaded: AtomicBool,
    /// Set when the load has ended, loaded or not.
    ended: tokio::sync::SetOnce<()>,
}

impl KnownKeys {
    fn hash(&self, account: &str, key: &str) -> u64 {
        self.hasher.hash_one((account, key))
    }

    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.set.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads every scope in the table in the background, so opening a large
    /// store does not wait for the scan. Until it is done every key may exist
    /// (claims read first, as without the set). The scan reads one snapshot;
    /// keys written meanwhile are added by their writers, and a key the
    /// reaper deletes meanwhile may stay (a stale entry only costs a read).
    pub(crate) fn spawn_load(self: &Arc<Self>, pool: SqlitePool) {
        /// Ends the load however the task ends, even dropped with its runtime
        /// half-way, so nobody waits for it forever.
        struct Ended(Arc<KnownKeys>);
        impl Drop for Ended {
            fn drop(&mut self) {
                let _ = self.0.ended.set(());
            }
        }
        let ended = Ended(self.clone());
        tokio::spawn(async move {
            let known = &ended.0;
            match known.load(&pool).await {
                Ok(()) => known.loaded.store(true, Ordering::Release),
                Err(e) => tracing::warn!(
                    error = %e,
                    "idemkit-sqlite: could not load the keys in the table; every claim reads its key first"
                ),
            }
        });
    }

    async fn load(&self, pool: &SqlitePool) -> StoreResult<()> {
        let mut rows =
            sqlx::query_as::<_, (String, String)>("SELECT account, idem_key FROM idemkit_keys").fetch(pool);
        while let Some((account, key)) = rows.try_next().await.map_err(map_err)? {
            let h = self.hash(&account, &key);
            self.set().insert(h);
        }
        Ok(())
    }

    /// Whether `scope` may have a row: `false` means no row this process
    /// knows of (see the module documentation for what that promises).
    pub(crate) fn may_exist(&self, scope: &Scope) -> bool {
        if !self.loaded.load(Ordering::Acquire) {
            return true;
        }
        let h = self.hash(scope.account.as_str(), scope.key.as_str());
        self.set().contains(&h)
    }

    /// Records that `scope` has a row.
    pub(crate) fn add(&self, scope: &Scope) {
        let h = self.hash(scope.account.as_str(), scope.key.as_str());
        self.set().insert(h);
    }

    /// Forgets scopes whose rows were deleted.
    pub(crate) fn forget<'a>(&self, scopes: impl IntoIterator<Item = (&'a str, &'a str)>) {
        let hashes: Vec<u64> = scopes.into_iter().map(|(a, k)| self.hash(a, k)).collect();
        let mut set = self.set();
        for h in hashes {
            set.remove(&h);
        }
    }

    /// Waits for the load to end; whether the table was loaded.
    pub(crate) async fn wait(&self) -> bool {
        self.ended.wait().await;
        self.loaded.load(Ordering::Acquire)
    }

    /// How many scopes are known, once the table is loaded.
    #[cfg(test)]
    pub(crate) async fn loaded_len(&self) -> usize {
        assert!(self.wait().await, "the table loads");
        self.set().len()
    }
}
