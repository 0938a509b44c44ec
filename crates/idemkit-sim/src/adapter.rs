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
/// lease-mode routes: the route policy, accounts from the bearer token. With
/// `replay_cache`, the layer keeps the answers it stored in process
/// (`IdempotencyLayerBuilder::replay_cache`), so the cached replay path runs
/// beside the store's own: the world turns it on for every other instance.
pub fn lease_layer(store: Arc<dyn KeyStore>, replay_cache: bool) -> IdempotencyLayer {
    let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new(ACCOUNT_SECRET)).policy(policy());
    let layer = if replay_cache {
        layer.replay_cache(64)
    } else {
        layer
    };
    layer.build().expect("a valid layer")
}

/// The single-step layer over a SQL store handle (claim, business write and
/// answer in one transaction).
pub fn single_step_layer<S: TransactionalStore>(store: Arc<S>) -> IdempotencyLayer {
    IdempotencyLayer::single_step(store, BearerTokenAccount::new(ACCOUNT_SECRET))
        .policy(policy())
        .build()
        .expect("a valid layer")
}
