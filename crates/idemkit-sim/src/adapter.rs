//! Every use of `idemkit-tower`'s layer-building API (the `IdempotencyLayer`
//! builders and the account resolver) in one place, so that a reshaping of that
//! API changes this file only. The world asks for a lease-mode or a single-step
//! layer over a store handle and gets a tower layer back.

use std::sync::Arc;

use idemkit_core::{KeyStore, TransactionalStore};
use idemkit_tower::{BearerTokenAccount, IdempotencyLayer};

use crate::world::policy;

/// The secret the instances derive accounts from bearer tokens with.
pub const ACCOUNT_SECRET: &[u8] = b"idemkit-sim account secret";

/// The account a bearer token resolves to, as the layers derive it.
pub fn account_of(token: &str) -> idemkit_core::Account {
    idemkit_core::Account::keyed(ACCOUNT_SECRET, token.as_bytes())
}

/// The lease-mode (generic) layer every instance puts in front of its keyed
/// lease-mode routes: the route policy, accounts from the bearer token.
pub fn lease_layer(store: Arc<dyn KeyStore>) -> IdempotencyLayer {
    IdempotencyLayer::lease(store, BearerTokenAccount::new(ACCOUNT_SECRET))
        .policy(policy())
        .build()
        .expect("a valid layer")
}

/// The single-step layer over a SQL store handle (claim, business write and
/// answer in one transaction).
pub fn single_step_layer<S: TransactionalStore>(store: Arc<S>) -> IdempotencyLayer {
    IdempotencyLayer::single_step(store, BearerTokenAccount::new(ACCOUNT_SECRET))
        .policy(policy())
        .build()
        .expect("a valid layer")
}
