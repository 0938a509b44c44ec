//! Extractors handlers use under the idempotency layer.

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use http::request::Parts;
use idemkit_core::{ErrorCode, FencingToken, Policy, Scope};

use crate::ProblemResponse;

/// How the layer in front of a handler claims keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClaimMode {
    /// [`crate::IdempotencyLayer::lease`]: the claim is committed under a lease
    /// before the handler runs; the handler may use [`crate::Phases`].
    Lease,
    /// [`crate::IdempotencyLayer::single_step`]: the claim is the open
    /// transaction the handler extracts as [`Tx`].
    SingleStep,
}

/// What the layer tells the handler about the claim it holds. Extract it in
/// an axum handler (or read it from the request extensions in a tonic one).
///
/// ```
/// use idemkit_tower::{ClaimMode, IdempotencyContext};
/// async fn handler(ctx: IdempotencyContext) -> String {
///     assert_eq!(ctx.mode(), ClaimMode::Lease);
///     format!("{:?} (lease {:?}, {:?} left)", ctx.scope, ctx.token, ctx.remaining())
/// }
/// # let _ = handler;
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
    #[doc(hidden)]
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

    /// How the layer claimed this request's key: [`crate::Phases`] needs
    /// [`ClaimMode::Lease`], [`Tx`] needs [`ClaimMode::SingleStep`].
    pub fn mode(&self) -> ClaimMode {
        self.mode
    }

    /// The time left until the caller's deadline (zero once it has passed), to
    /// bound the handler's own work and to hand on to downstream calls;
    /// `None` when the caller sent no deadline.
    pub fn remaining(&self) -> Option<Duration> {
        crate::engine::remaining(self.deadline)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = ProblemResponse;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            ProblemResponse::new(
                ErrorCode::Internal,
                "the idempotency layer is not applied to this route",
            )
        })
    }
}

type Boxed = Box<dyn Any + Send>;

/// Where the claim's open transaction waits between the layer and the handler.
#[derive(Clone, Default)]
pub(crate) struct TxSlot(pub(crate) Arc<Mutex<Option<Boxed>>>);

impl TxSlot {
    pub(crate) fn put(&self, tx: Boxed) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
    }

    pub(crate) fn take(&self) -> Option<Boxed> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The claim's own transaction, handed to a single-step handler: business writes
/// made through it commit together with the claim and the stored response, or
/// not at all.
///
/// `T` is the store's transaction type, e.g. `idemkit_sqlite::SqliteTx`. The
/// handler borrows it; when the handler returns, the layer stores the response
/// in it and commits. Holding it beyond the handler (moving it into a spawned
/// task) is refused with a 500 and the transaction rolls back.
///
/// ```
/// use http::StatusCode;
/// use idemkit_sqlite::SqliteTx;
/// use idemkit_tower::{ProblemResponse, Tx};
///
/// // Runs at most once per (account, key): this insert, the claim and the
/// // stored 201 commit together.
/// async fn create(mut tx: Tx<SqliteTx>) -> Result<StatusCode, ProblemResponse> {
///     sqlx::query("INSERT INTO orders DEFAULT VALUES")
///         .execute(&mut **tx)
///         .await
///         .map_err(|e| ProblemResponse::new(idemkit_core::ErrorCode::Internal, e.to_string()))?;
///     Ok(StatusCode::CREATED)
/// }
/// # let _ = create;
/// ```
pub struct Tx<T: Send + 'static> {
    inner: Option<T>,
    slot: TxSlot,
}

impl<T: Send + 'static> Deref for Tx<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // `inner` is only `None` inside `drop`.
        self.inner
            .as_ref()
            .unwrap_or_else(|| unreachable!("transaction already returned"))
    }
}

impl<T: Send + 'static> DerefMut for Tx<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.inner
            .as_mut()
            .unwrap_or_else(|| unreachable!("transaction already returned"))
    }
}

impl<T: Send + 'static> Drop for Tx<T> {
    fn drop(&mut self) {
        if let Some(tx) = self.inner.take() {
            self.slot.put(Box::new(tx));
        }
    }
}

impl<T: Send + 'static> std::fmt::Debug for Tx<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx { .. }")
    }
}

impl<T: Send + 'static, S: Send + Sync> FromRequestParts<S> for Tx<T> {
    type Rejection = ProblemResponse;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let slot = parts.extensions.get::<TxSlot>().cloned().ok_or_else(|| {
            tracing::error!("idempotency: a handler extracts Tx on a route that is not single-step");
            ProblemResponse::new(
                ErrorCode::Misconfigured,
                "this handler extracts `Tx`, which only a single-step layer (`IdempotencyLayer::single_step`) provides; nothing ran",
            )
        })?;
        let boxed = slot.take().ok_or_else(|| {
            ProblemResponse::new(ErrorCode::Internal, "the claim transaction was already extracted")
        })?;
        match boxed.downcast::<T>() {
            Ok(tx) => Ok(Self {
                inner: Some(*tx),
                slot,
            }),
            Err(boxed) => {
                slot.put(boxed);
                tracing::error!(
                    expected = std::any::type_name::<T>(),
                    "idempotency: a handler extracts the transaction of another store"
                );
                Err(ProblemResponse::new(
                    ErrorCode::Misconfigured,
                    format!(
                        "this handler extracts `Tx<{}>`, which is not the layer's store's transaction; nothing ran",
                        std::any::type_name::<T>()
                    ),
                ))
            }
        }
    }
}
