//! The response future of [`crate::Idempotency`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::Response;

/// The future [`crate::Idempotency`] returns: the claim, the handler, storing
/// the answer (or the replay), boxed once per request.
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(f: impl Future<Output = Result<Response, E>> + Send + 'static) -> Self {
        Self { inner: Box::pin(f) }
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture { .. }")
    }
}
