//! The layer and its builder.

use std::sync::Arc;

use http::{HeaderName, Method};
use idemkit_core::{Fingerprinter, IntoKeyStore, IntoTransactionalStore, PointerError, Policy, PolicyError};
use tower::Layer;

use crate::shared::{DEFAULT_STATUS_PATH, IDEMPOTENCY_KEY, KeySource, Shared, Validator};
use idemkit_engine::{Engine, EngineStore};

use crate::AccountResolver;
use crate::service::Idempotency;

/// A tower [`Layer`] that makes the wrapped routes require an idempotency key and
/// enforces the idemkit contract on them.
///
/// Two modes, each with its one constructor; both take the store (by value: every
/// store is a cheap clone) and the [`AccountResolver`] that scopes keys per account:
/// - **single-step** ([`IdempotencyLayer::single_step`]): the claim, the
///   handler's business writes (through the [`crate::Tx`] extractor) and the
///   stored response commit in one transaction of a SQL store;
/// - **lease** ([`IdempotencyLayer::lease`]): for any [`KeyStore`](idemkit_core::KeyStore) and handlers
///   whose writes live elsewhere (or span several systems, with
///   [`crate::Phases`]): the claim commits as `in_flight` with a lease kept
///   alive by a heartbeat, then the response is stored with a fenced write.
///
/// ```
/// use idemkit_tower::{BearerTokenAccount, IdempotencyLayer, Unscoped};
/// // Any store by value (the idemkit stores are cheap clones), or shared as an `Arc`.
/// let store = std::sync::Arc::new(idemkit_testkit::MemoryStore::new());
/// let layer = IdempotencyLayer::lease(store.clone(), BearerTokenAccount::new(b"secret".to_vec()))
///     .build()
///     .unwrap();
/// // A single-tenant deployment says so explicitly:
/// let single_tenant = IdempotencyLayer::lease(store, Unscoped).build().unwrap();
/// # let _ = (layer, single_tenant);
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.shared.engine)
            .field("key_source", &self.shared.key_source)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Lease mode on any store: the claim commits as `in_flight` under a
    /// heartbeat-kept lease, the answer is stored with a fenced write.
    /// Handlers may use [`crate::Phases`]; [`crate::Tx`] is refused (`500
    /// idempotency_misconfigured`).
    pub fn lease(store: impl IntoKeyStore, resolver: impl AccountResolver) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder::new(EngineStore::lease(store), Arc::new(resolver))
    }

    /// Single-step mode on a SQL store: handlers extract
    /// [`crate::Tx`]`<S::Tx>` (e.g. `Tx<SqliteTx>`), and the claim, their
    /// writes and the stored answer commit in one transaction. [`crate::Phases`]
    /// is refused (`500 idempotency_misconfigured`).
    pub fn single_step(
        store: impl IntoTransactionalStore,
        resolver: impl AccountResolver,
    ) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder::new(EngineStore::single_step(store), Arc::new(resolver))
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        self.shared.engine.policy()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}

/// Why [`IdempotencyLayerBuilder::build`] refused a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The policy breaks an invariant of the contract.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A fingerprint exclusion is not a JSON pointer.
    #[error(transparent)]
    Pointer(#[from] PointerError),
    /// The JSON key field is not a JSON pointer.
    #[error("key field `{0}` must be a JSON pointer such as `/idempotencyKey`")]
    BadKeyField(String),
}

/// Builds an [`IdempotencyLayer`]; [`IdempotencyLayerBuilder::build`] validates.
pub struct IdempotencyLayerBuilder {
    store: EngineStore,
    policy: Policy,
    excluded: Vec<String>,
    key_source: KeySource,
    resolver: Arc<dyn AccountResolver>,
    max_request_body: usize,
    methods: Vec<Method>,
    status_path: String,
    validator: Option<Arc<Validator>>,
    replay_cache: Option<usize>,
}

impl std::fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayerBuilder {
    fn new(store: EngineStore, resolver: Arc<dyn AccountResolver>) -> Self {
        Self {
            store,
            policy: Policy::new(),
            excluded: Vec::new(),
            key_source: KeySource::Header(HeaderName::from_static(IDEMPOTENCY_KEY)),
            resolver,
            max_request_body: 1024 * 1024,
            methods: vec![Method::POST, Method::PUT, Method::PATCH, Method::DELETE],
            status_path: DEFAULT_STATUS_PATH.to_owned(),
            validator: None,
            replay_cache: None,
        }
    }

    /// Sets the route policy (windows, lease, in-flight and 5xx behaviour, …).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Reads the key from another header.
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.key_source = KeySource::Header(name);
        self
    }

    /// Reads the key from a string field of the JSON body (a JSON pointer). The
    /// field is excluded from the fingerprint.
    pub fn key_json_field(mut self, pointer: impl Into<String>) -> Self {
        let pointer = pointer.into();
        self.excluded.push(pointer.clone());
        self.key_source = KeySource::JsonField(pointer);
        self
    }

    /// Speaks OASIS Repeatable Requests 1.0 instead of `Idempotency-Key`: the key
    /// is the `Repeatability-Request-ID` header, `Repeatability-First-Sent` is
    /// required and must be inside the replay window (else `412`), and answers
    /// carry `Repeatability-Result` (see [`KeySource::Repeatability`]).
    pub fn repeatability(mut self) -> Self {
        self.key_source = KeySource::Repeatability;
        self
    }

    /// Excludes a JSON field (pointer) from the fingerprint.
    pub fn exclude_from_fingerprint(mut self, pointer: impl Into<String>) -> Self {
        self.excluded.push(pointer.into());
        self
    }

    /// Largest request body accepted (default 1 MiB); larger is `413`.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// The methods that require a key (default POST, PUT, PATCH, DELETE); other
    /// methods pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Where the status URLs of the `accepted` in-flight behaviour live (default
    /// `/idempotency/requests`); serve them with [`IdempotencyLayer::status_router`].
    pub fn status_path(mut self, path: impl Into<String>) -> Self {
        self.status_path = path.into();
        self
    }

    /// Validates each request body before its key is looked up, so an invalid
    /// body is answered with the route's problem (usually `400`) whatever state its
    /// key is in, and never claims the key.
    pub fn validate_body(
        mut self,
        validate: impl Fn(&http::request::Parts, &[u8]) -> Result<(), crate::ProblemResponse>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.validator = Some(Arc::new(validate));
        self
    }

    /// Keeps up to about `capacity` of the answers this process stores in
    /// memory, keyed by scope and fingerprint, and replays a retry of the same
    /// request from there without a store round trip, until the record's replay
    /// window ends. Off by default: it costs memory, and where several instances
    /// share a store it only serves retries that reach the instance that stored
    /// the answer (the store answers the rest, identically). A completed record
    /// does not change within its window, so the cache never answers differently
    /// from the store. It holds only answers the layer stores itself: a handler
    /// written with `Phases` completes its record in its final phase, so its
    /// retries are answered by the store.
    pub fn replay_cache(mut self, capacity: usize) -> Self {
        self.replay_cache = Some(capacity);
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<IdempotencyLayer, BuildError> {
        self.policy.validate()?;
        if let KeySource::JsonField(p) = &self.key_source
            && !p.starts_with('/')
        {
            return Err(BuildError::BadKeyField(p.clone()));
        }
        let mut fingerprinter = Fingerprinter::new();
        for pointer in self.excluded {
            fingerprinter = fingerprinter.exclude(pointer)?;
        }
        let mut engine = Engine::new(self.store, self.policy, fingerprinter)?;
        if let Some(capacity) = self.replay_cache {
            engine = engine.with_replay_cache(capacity);
        }
        Ok(IdempotencyLayer {
            shared: Arc::new(Shared {
                engine,
                key_source: self.key_source,
                resolver: self.resolver,
                max_request_body: self.max_request_body,
                methods: self.methods,
                status_path: self.status_path,
                validator: self.validator,
            }),
        })
    }
}
