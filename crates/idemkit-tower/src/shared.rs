//! What the layer, its service and its status routes share: the route's engine
//! and the HTTP adapter's settings. Nothing here imports the service, so the
//! modules form no cycle (layer → service → shared, status → shared).

use std::sync::Arc;

use http::{HeaderName, Method};

use crate::engine::Engine;
use crate::resolver::AccountResolver;

/// Where the key is read from.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// A request header (default `Idempotency-Key`).
    Header(HeaderName),
    /// A string field of the JSON body, by JSON pointer (e.g. `/idempotencyKey`).
    JsonField(String),
}

/// What every request of a route shares: the engine and the HTTP adapter's
/// settings.
/// What every request of a route shares.
pub(crate) struct Shared {
    pub(crate) engine: Engine,
    pub(crate) key_source: KeySource,
    pub(crate) resolver: Arc<dyn AccountResolver>,
    pub(crate) max_request_body: usize,
    pub(crate) methods: Vec<Method>,
    pub(crate) status_path: String,
    pub(crate) validator: Option<Arc<Validator>>,
}

/// A route's own request validation, run before the key is looked up.
pub(crate) type Validator =
    dyn Fn(&http::request::Parts, &[u8]) -> Result<(), crate::ProblemResponse> + Send + Sync;

/// The default key header.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Default prefix of the status URLs handed out with `202 Accepted`.
pub const DEFAULT_STATUS_PATH: &str = "/idempotency/requests";
/// The header marking a replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
