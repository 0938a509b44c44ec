//! The routes that publish a contract from the running configuration.

use axum::Router;
use axum::response::Html;
use axum::routing::get;

use crate::{Contract, Format};

/// An axum router serving `contract` at `GET /docs/idempotency` (the HTML page)
/// and `GET /docs/idempotency.json` (the policy document, the `x-idempotency`
/// object of every route). Both are rendered once, here, from the configuration
/// the service runs with; merge the router into the service's own.
pub fn router<S>(contract: &Contract) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let page = contract.render(Format::Html);
    let policy = contract.policy_document();
    Router::new()
        .route("/docs/idempotency", get(move || async move { Html(page) }))
        .route(
            "/docs/idempotency.json",
            get(move || async move { axum::Json(policy) }),
        )
}
