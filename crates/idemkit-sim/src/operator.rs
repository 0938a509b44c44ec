//! The operator's commands as actors, through the library functions the CLI
//! runs: `idemkit keys release` (with and without `--downstream-did-nothing`)
//! is [`idemkit_tower::release_key`], and `idemkit keys complete` is one
//! [`Completer::run_once`] pass over the application's router.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use idemkit_core::{KeyStore, Scope, StoreResult};
use idemkit_tower::{Completer, CompleterReport, ReleaseRefused, Released};

/// `idemkit keys release --account A --key K [--downstream-did-nothing]`.
pub async fn release(
    store: &dyn KeyStore,
    scope: &Scope,
    downstream_did_nothing: bool,
) -> StoreResult<Result<Released, ReleaseRefused>> {
    idemkit_tower::release_key(store, scope, downstream_did_nothing).await
}

/// `idemkit keys complete --min-age-ms M`: one completer pass over `app`.
pub async fn complete(
    store: Arc<dyn KeyStore>,
    app: Router,
    min_age: Duration,
) -> StoreResult<CompleterReport> {
    Completer::new(store, app)
        .min_age(min_age)
        .batch(100)
        .run_once()
        .await
}
