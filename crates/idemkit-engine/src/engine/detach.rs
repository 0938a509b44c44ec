//! Running a claimed attempt to its end even when the caller goes away.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The handler panicked; the payload is dropped (it was logged by the panic hook).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Panicked;

/// A future polled in place, on the caller's task, that goes on to completion
/// in a task of its own if it is dropped before it finishes (the connection
/// closed, the caller cancelled: exactly when clients retry). What a lease-mode
/// request needs from the moment its claim is sent (a claim can land after its
/// future is dropped): the handler never stops half-way and the key is never
/// left waiting for a lease to expire. Spawning every
/// attempt up front would give the same guarantee at the cost of a task and a
/// cross-thread hand-off per request; this pays only when the caller leaves.
///
/// A panic in the future is caught and answered as [`Panicked`], as a task's
/// join handle would; the future is not polled again. Only while polled in
/// place: once moved to its own task nobody is left to answer, so work that
/// must settle something after a panic catches it itself (as
/// [`crate::Attempt::catch_panic`] does for the handler).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::time::Duration;
/// use idemkit_engine::Detached;
///
/// let finished = Arc::new(AtomicBool::new(false));
/// let work = {
///     let finished = finished.clone();
///     async move {
///         tokio::time::sleep(Duration::from_millis(20)).await;
///         finished.store(true, Ordering::SeqCst);
///     }
/// };
/// // The caller gives up after 1 ms: the work goes on without it.
/// let _ = tokio::time::timeout(Duration::from_millis(1), Detached::new(work)).await;
/// tokio::time::sleep(Duration::from_millis(50)).await;
/// assert!(finished.load(Ordering::SeqCst));
/// # }
/// ```
pub struct Detached<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> std::fmt::Debug for Detached<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detached")
            .field("running", &self.future.is_some())
            .finish()
    }
}

impl<T: Send + 'static> Detached<T> {
    /// Wraps `future` (boxed once, so it can move to a task after being polled).
    pub fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = Result<T, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            panic!("Detached polled after it finished");
        };
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                self.future = None;
                Poll::Ready(Ok(out))
            }
            Err(_) => {
                self.future = None;
                Poll::Ready(Err(Panicked))
            }
        }
    }
}

/// Runs `future` to its end, answering [`Panicked`] if a poll of it panics
/// (the future is then dropped, never polled again). What lets the work that
/// [`Detached`] may move to a task of its own settle its attempt after a panic
/// itself, wherever it is polled.
pub(crate) async fn catch_unwind<F: Future>(future: F) -> Result<F::Output, Panicked> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(_) => Poll::Ready(Err(Panicked)),
        }
    })
    .await
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(future);
                }
                Err(_) => tracing::error!(
                    "idempotency: an unfinished attempt was dropped outside a Tokio runtime; its lease will expire"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_answered_and_never_polled_again() {
        let answered = Detached::new(async { panic!("handler bug") }).await;
        assert_eq!(answered, Err::<(), _>(Panicked));
    }

    #[tokio::test]
    async fn a_finished_future_is_not_spawned_on_drop() {
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let done =
            Detached::new(async move { counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) }).await;
        assert_eq!(done, Ok(0));
        tokio::task::yield_now().await;
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
