//! Every use of `idemkit-tower`'s layer-building API (the `IdempotencyLayer`
//! builders and the account resolver) in one place, so that a reshaping of that
//! API changes this file only. The world asks for a lease-mode or a single-step
//! layer over a store handle and gets a tower layer back.

use std::sync::Arc;

use idemkit_core::{KeyStore, TransactionalStore};
use idemkit_tower::{BearerTokenAccount, IdempotencyLayer};

use crate::world::policy;

/// The lease-mode (generic) layer every instance puts in front of its keyed
/// lease-mode routes: the route policy, accounts from the bearer token.
pub fn lease_layer(store: Arc<dyn KeyStore>) -> IdempotencyLayer {
    IdempotencyLayer::builder(store)
        .policy(policy())
        .resolver(BearerTokenAccount)
        .build()
        .expect("a valid layer")
}

/// The single-step layer over a SQL store handle (claim, business write and
/// answer in one transaction).
pub fn single_step_layer<S: TransactionalStore>(store: Arc<S>) -> IdempotencyLayer {
    IdempotencyLayer::transactional(store)
        .policy(policy())
        .resolver(BearerTokenAccount)
        .build()
        .expect("a valid layer")
}
