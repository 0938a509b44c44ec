//! The scopes this process knows to have a row in the key table, so a claim
//! of any other key can skip the read that would only find it absent.
//!
//! The set is a hint, never the arbiter: the table's primary key is. It holds
//! a 64-bit hash of every scope this store read or wrote a row for since it
//! loaded the table at open, and loses the ones its reaper deletes. A scope
//! missing from it is either absent or was written by another process (or
//! another store on the same file) since; a claim that skips the read then
//! meets that row at its insert, which fails on the primary key: a lease-mode
//! claim falls back to the read-and-decide path, and a single-step claim's
//! transaction (the handler's writes with it) rolls back with
//! [`StoreError::Conflict`](idemkit_core::StoreError::Conflict), after which
//! the layer answers what the key answers. A hash collision only makes a claim
//! read first, as it did before the set existed.
//!
//! Memory: about 16 bytes per record in the table.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::Mutex;

use futures::TryStreamExt;
use idemkit_core::{Scope, StoreResult};
use sqlx::SqlitePool;

use crate::error::map_err;

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct KnownKeys {
    hasher: std::hash::RandomState,
    set: Mutex<HashSet<u64>>,
}

impl KnownKeys {
    fn hash(&self, account: &str, key: &str) -> u64 {
        self.hasher.hash_one((account, key))
    }

    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.set.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads every scope in the table.
    pub(crate) async fn load(pool: &SqlitePool) -> StoreResult<Self> {
        let known = Self::default();
        let mut rows =
            sqlx::query_as::<_, (String, String)>("SELECT account, idem_key FROM idemkit_keys").fetch(pool);
        while let Some((account, key)) = rows.try_next().await.map_err(map_err)? {
            let h = known.hash(&account, &key);
            known.set().insert(h);
        }
        drop(rows);
        Ok(known)
    }

    /// Whether `scope` may have a row: `false` means no row this process
    /// knows of (see the module documentation for what that promises).
    pub(crate) fn may_exist(&self, scope: &Scope) -> bool {
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

    /// How many scopes are known.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.set().len()
    }
}
