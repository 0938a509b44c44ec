//! The single-step handler's extractor: the claim's own transaction.

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use http::request::Parts;
use idemkit_core::ErrorCode;
use idemkit_engine::ProblemResponse;

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
