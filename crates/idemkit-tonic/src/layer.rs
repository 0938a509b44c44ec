//! The layer and its builder.

use std::collections::HashMap;
use std::sync::Arc;

use http::HeaderName;
use idemkit_core::{InFlightBehavior, KeyStore, Policy, PolicyError};
use idemkit_tower::engine::Engine;
use tower::Layer;

use crate::IDEMPOTENCY_KEY;
use crate::resolver::{MetadataAccountResolver, Unscoped};
use crate::service::Idempotency;

/// Where a method's key comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyField {
    /// Only the key metadata.
    Metadata,
    /// This string field of the request message; the key metadata when the
    /// field is empty.
    Field(u32),
}

pub(crate) struct Shared {
    pub(crate) engine: Engine,
    pub(crate) resolver: Arc<dyn MetadataAccountResolver>,
    pub(crate) key_metadata: HeaderName,
    pub(crate) methods: HashMap<String, KeyField>,
    pub(crate) max_request_message: usize,
}

/// A tower [`Layer`] for tonic servers (`Server::builder().layer(..)`) that
/// makes the configured unary methods require an idempotency key and enforces
/// the idemkit contract on them (lease mode: the claim commits as `in_flight`
/// with a heartbeat-kept lease, the answer is stored with a fenced write).
/// Other methods pass through untouched.
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.shared.engine)
            .field("methods", &self.shared.methods)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Starts a layer over any key store.
    pub fn builder(store: Arc<dyn KeyStore>) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            store,
            policy: Policy::new(),
            resolver: None,
            key_metadata: HeaderName::from_static(IDEMPOTENCY_KEY),
            methods: HashMap::new(),
            max_request_message: 4 * 1024 * 1024,
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}

/// Why a layer could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The policy breaks an invariant of the contract.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// No account resolver and no explicit unscoped choice.
    #[error(
        "keys must be scoped per account: set a resolver with `.resolver(..)`, or call `.unscoped()` to run single-tenant on purpose"
    )]
    NoResolver,
    /// No method was named.
    #[error(
        "name the unary methods that take idempotency keys with `.unary(..)` or `.unary_with_key_field(..)`"
    )]
    NoMethods,
    /// A method is not a full method name.
    #[error("`{0}` is not a full gRPC method name such as `/pkg.Service/Method`")]
    BadMethod(String),
    /// The `accepted` in-flight behaviour (`202` with a status URL) has no gRPC form.
    #[error("the `accepted` in-flight behaviour is HTTP-only; use reject or wait")]
    AcceptedInFlight,
}

/// Builds an [`IdempotencyLayer`]; [`IdempotencyLayerBuilder::build`] validates.
pub struct IdempotencyLayerBuilder {
    store: Arc<dyn KeyStore>,
    policy: Policy,
    resolver: Option<Arc<dyn MetadataAccountResolver>>,
    key_metadata: HeaderName,
    methods: HashMap<String, KeyField>,
    max_request_message: usize,
}

impl std::fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("policy", &self.policy)
            .field("methods", &self.methods)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayerBuilder {
    /// Sets the policy (windows, lease, in-flight and server-error behaviour, …).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the account resolver (required unless [`Self::unscoped`]).
    pub fn resolver(mut self, resolver: impl MetadataAccountResolver) -> Self {
        self.resolver = Some(Arc::new(resolver));
        self
    }

    /// Runs unscoped: all callers share one key space (single-tenant only).
    pub fn unscoped(mut self) -> Self {
        self.resolver = Some(Arc::new(Unscoped));
        self
    }

    /// Reads the key from another metadata entry (default `idempotency-key`).
    pub fn key_metadata(mut self, name: HeaderName) -> Self {
        self.key_metadata = name;
        self
    }

    /// Makes the unary method `path` (`/pkg.Service/Method`) require a key, read
    /// from the key metadata.
    pub fn unary(mut self, path: impl Into<String>) -> Self {
        self.methods.insert(path.into(), KeyField::Metadata);
        self
    }

    /// Makes the unary method `path` require a key, read from the top-level
    /// `string` field `number` of its request message (the field the API
    /// defines), or from the key metadata when that field is empty. A call that
    /// sets both to different keys is `INVALID_ARGUMENT`.
    pub fn unary_with_key_field(mut self, path: impl Into<String>, number: u32) -> Self {
        self.methods.insert(path.into(), KeyField::Field(number));
        self
    }

    /// Largest request message accepted (default 4 MiB, tonic's default);
    /// larger is `RESOURCE_EXHAUSTED`.
    pub fn max_request_message(mut self, bytes: usize) -> Self {
        self.max_request_message = bytes;
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<IdempotencyLayer, ConfigError> {
        if self.policy.in_flight == InFlightBehavior::Accepted {
            return Err(ConfigError::AcceptedInFlight);
        }
        if self.methods.is_empty() {
            return Err(ConfigError::NoMethods);
        }
        if let Some(bad) = self.methods.keys().find(|m| !is_method_path(m)) {
            return Err(ConfigError::BadMethod(bad.clone()));
        }
        let resolver = self.resolver.ok_or(ConfigError::NoResolver)?;
        Ok(IdempotencyLayer {
            shared: Arc::new(Shared {
                engine: Engine::lease(self.store, self.policy)?,
                resolver,
                key_metadata: self.key_metadata,
                methods: self.methods,
                max_request_message: self.max_request_message,
            }),
        })
    }
}

fn is_method_path(p: &str) -> bool {
    let Some(rest) = p.strip_prefix('/') else {
        return false;
    };
    matches!(rest.split_once('/'), Some((svc, m)) if !svc.is_empty() && !m.is_empty() && !m.contains('/'))
}
