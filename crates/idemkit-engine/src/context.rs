//! What an adapter tells the handler about the claim it holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit_core::{FencingToken, Policy, Scope};

/// How the layer in front of a handler claims keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClaimMode {
    /// Lease mode (`idemkit_tower::IdempotencyLayer::lease`): the claim is
    /// committed under a lease before the handler runs; the handler may use
    /// `idemkit_tower::Phases`.
    Lease,
    /// Single-step mode (`idemkit_tower::IdempotencyLayer::single_step`): the claim is the open
    /// transaction the handler extracts as `idemkit_tower::Tx`.
    SingleStep,
}

/// What the layer tells the handler about the claim it holds. Extract it in
/// an axum handler (feature `axum`; `idemkit-tower` re-exports it), or read it
/// from the request extensions in a tonic one.
///
/// ```
/// use idemkit_engine::{ClaimMode, IdempotencyContext};
/// fn describe(ctx: &IdempotencyContext) -> String {
///     assert_eq!(ctx.mode(), ClaimMode::Lease);
///     format!("{:?} (lease {:?}, {:?} left)", ctx.scope, ctx.token, ctx.remaining())
/// }
/// // In a tonic handler: `request.extensions().get::<IdempotencyContext>()`.
/// # let _ = describe;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct IdempotencyContext {
    /// (account, key) of the request.
    pub scope: Scope,
    /// The fencing token of this attempt's lease.
    pub token: FencingToken,
    /// Set when this attempt took over an abandoned one: its last recovery point.
    pub resumed_from: Option<String>,
    /// The route's policy (phases need its stored-header allowlist and body cap).
    pub policy: Arc<Policy>,
    /// The caller's deadline, from the REST [`idemkit_core::wire::REQUEST_TIMEOUT`]
    /// (milliseconds remaining when the request arrived) or gRPC's
    /// `grpc-timeout`; `None` when the caller sent none. See
    /// [`IdempotencyContext::remaining`].
    pub deadline: Option<Instant>,
    pub(crate) mode: ClaimMode,
}

impl IdempotencyContext {
    /// The context of a claim (built by the adapters).
    pub fn new(
        scope: Scope,
        token: FencingToken,
        resumed_from: Option<String>,
        policy: Arc<Policy>,
        deadline: Option<Instant>,
        mode: ClaimMode,
    ) -> Self {
        Self {
            scope,
            token,
            resumed_from,
            policy,
            deadline,
            mode,
        }
    }

    /// How the layer claimed this request's key: `idemkit_tower::Phases` needs
    /// [`ClaimMode::Lease`], `idemkit_tower::Tx` needs [`ClaimMode::SingleStep`].
    pub fn mode(&self) -> ClaimMode {
        self.mode
    }

    /// The time left until the caller's deadline (zero once it has passed), to
    /// bound the handler's own work and to hand on to downstream calls;
    /// `None` when the caller sent no deadline.
    pub fn remaining(&self) -> Option<Duration> {
        crate::remaining(self.deadline)
    }
}
