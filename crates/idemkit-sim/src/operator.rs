//! The operator's commands as actors: `idemkit keys release` (with and without
//! `--downstream-did-nothing`) and `idemkit keys complete`.
//!
//! The CLI's functions (`apps/idemkit-cli/src/keys/commands.rs`, `release`
//! and `complete`) are private to the `idemkit-cli` crate (`pub(super)`, they
//! take its clap arguments, open the store from a URL and print tables), so
//! they cannot be called as a library. This module makes the store-level
//! calls they make, in the same order and on the same decisions: `release`
//! reads the record, refuses a missing, completed or released record and one
//! held by a live lease, and then calls `discard_progress` (the flag given and
//! the record has progress) or `force_release`; `complete` is one
//! [`Completer::run_once`] pass over the application's router.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use idemkit_core::{KeyStore, Record, RecordState, Scope, StoreResult};
use idemkit_tower::{Completer, CompleterReport};

/// What `idemkit keys release` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Refused, with the CLI's reason (it exits 1).
    Refused(&'static str),
    /// Released; recorded progress kept (`force_release`).
    Released,
    /// Released and its progress discarded (`discard_progress`).
    Discarded,
}

/// `idemkit keys release --account A --key K [--downstream-did-nothing]`.
pub async fn release(
    store: &dyn KeyStore,
    scope: &Scope,
    downstream_did_nothing: bool,
) -> StoreResult<Release> {
    let now = store.now();
    let before = store.get(scope).await?;
    let refused = match &before {
        None => Some("no record with this account and key"),
        Some(r) => match r.state {
            RecordState::Completed => Some("completed: not released"),
            RecordState::Released => Some("already released"),
            RecordState::InFlight if r.lease_expires_at > now => Some("held by a live lease"),
            RecordState::InFlight | RecordState::Parked => None,
            _ => Some("not released"),
        },
    };
    if let Some(why) = refused {
        return Ok(Release::Refused(why));
    }
    let discard = downstream_did_nothing && before.as_ref().is_some_and(Record::has_progress);
    let released = if discard {
        store.discard_progress(scope).await?
    } else {
        store.force_release(scope).await?
    };
    Ok(match (released, discard) {
        (false, _) => Release::Refused("the store refused (a holder took it meanwhile)"),
        (true, true) => Release::Discarded,
        (true, false) => Release::Released,
    })
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
