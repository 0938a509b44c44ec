//! What the layer, its service and its status routes share: the route's engine
//! and the HTTP adapter's settings. Nothing here imports the service, so the
//! modules form no cycle (layer → service → shared, status → shared).

use std::sync::Arc;

use http::{HeaderName, Method};

use crate::AccountResolver;
use idemkit_engine::Engine;

/// Where the key is read from.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// A request header (default `Idempotency-Key`).
    Header(HeaderName),
    /// A string field of the JSON body, by JSON pointer (e.g. `/idempotencyKey`).
    JsonField(String),
    /// OASIS Repeatable Requests 1.0: the key is the `Repeatability-Request-ID`
    /// header, and `Repeatability-First-Sent` (an HTTP-date) is required and must
    /// fall inside the replay window, else `412
    /// repeatability_first_sent_out_of_window`. Every answer the layer gives
    /// carries `Repeatability-Result: accepted` or `rejected`.
    Repeatability,
}

pub(crate) use idemkit_core::wire::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, REPEATABILITY_FIRST_SENT, REPEATABILITY_REQUEST_ID,
    REPEATABILITY_RESULT,
};

/// How far in the future a `Repeatability-First-Sent` may be (the caller's
/// clock may run ahead of ours) before it is outside the window.
pub const REPEATABILITY_CLOCK_SKEW: std::time::Duration = std::time::Duration::from_secs(60);

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

/// Default prefix of the status URLs handed out with `202 Accepted`.
pub const DEFAULT_STATUS_PATH: &str = "/idempotency/requests";
