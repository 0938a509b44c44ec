//! The `accepted` in-flight behaviour: `202` with a status URL the layer serves.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::request::Parts;
use idemkit_core::{ErrorCode, IdempotencyKey, RecordState, Scope};

use crate::response::{in_progress, replay_response, store_problem};
use crate::shared::Shared;
use crate::{IdempotencyLayer, ProblemResponse};

async fn status(State(shared): State<Arc<Shared>>, Path(key): Path<String>, parts: Parts) -> Response {
    let account = match shared.resolver.resolve(&parts) {
        Ok(a) => a,
        Err(p) => return p.into_response(),
    };
    let key = match IdempotencyKey::parse(&key) {
        Ok(k) => k,
        Err(e) => return ProblemResponse::new(e.code(), e.to_string()).into_response(),
    };
    let scope = Scope::new(account, key);
    let now = shared.engine.store().now();
    match shared.engine.store().get(&scope).await {
        Ok(Some(r)) => match (r.state, r.response) {
            // Past the replay window a completed record no longer replays (the
            // key is a new request then), and neither does its status URL.
            (RecordState::Completed, Some(stored))
                if r.completed_at
                    .unwrap_or(r.created_at)
                    .plus(shared.engine.policy().replay_window)
                    > now =>
            {
                replay_response(stored, shared.engine.policy())
            }
            (RecordState::InFlight, _) => in_progress(
                None,
                shared
                    .engine
                    .policy()
                    .in_progress_hint(now.until(r.lease_expires_at)),
            ),
            (RecordState::Parked, _) => ProblemResponse::new(
                ErrorCode::RequestParked,
                "this request was parked for human review; it will not run again",
            )
            .into_response(),
            _ => ProblemResponse::new(ErrorCode::NotFound, "no request with this key").into_response(),
        },
        // Another account's key is indistinguishable from no key.
        Ok(None) => ProblemResponse::new(ErrorCode::NotFound, "no request with this key").into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}

impl IdempotencyLayer {
    /// The routes that serve the status URLs handed out by the `accepted`
    /// in-flight behaviour: `GET {status_path}/{key}` answers `202` with
    /// `{"status":"in_progress"}` while the request runs, then its stored response
    /// (with `Idempotent-Replayed: true`). Keys are scoped by the caller's account.
    /// Merge it into the application's router.
    pub fn status_router<St: Clone + Send + Sync + 'static>(&self) -> Router<St> {
        let path = format!("{}/{{key}}", self.shared.status_path.trim_end_matches('/'));
        Router::new()
            .route(&path, get(status))
            .with_state(self.shared.clone())
    }
}
