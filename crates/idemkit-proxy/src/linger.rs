//! Lingering close for request bodies the proxy refuses before reading them.
//!
//! A caller still sending a body when the proxy answers (a budget refusal, a
//! missing credential, a malformed key, a body over the limit) gets a
//! connection reset instead of the answer if the connection closes under it:
//! the client's write fails before it reads the `503` with `Retry-After`. As
//! nginx's lingering close does, a body dropped before its end is read and
//! discarded in the background, bounded in bytes and time, so the caller sees
//! the answer; nothing of it is kept.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

/// A request body that is drained (up to `limit` bytes, for at most `time`)
/// when dropped before its end.
pub(crate) struct Lingering {
    inner: Option<Body>,
    ended: bool,
    limit: usize,
    time: Duration,
}

impl Lingering {
    /// Wraps `inner`; an unread rest of up to `limit` bytes is drained for at
    /// most `time` after the body is dropped.
    pub(crate) fn new(inner: Body, limit: usize, time: Duration) -> Self {
        Self {
            inner: Some(inner),
            ended: false,
            limit,
            time,
        }
    }
}

impl http_body::Body for Lingering {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            this.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint)
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(mut body) = self.inner.take() else {
            return;
        };
        if self.ended || http_body::Body::is_end_stream(&body) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (limit, time) = (self.limit, self.time);
        runtime.spawn(async move {
            let drain = async {
                let mut seen = 0usize;
                while let Some(Ok(frame)) = body.frame().await {
                    seen = seen.saturating_add(frame.data_ref().map_or(0, Bytes::len));
                    if seen > limit {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(time, drain).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Sender = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, axum::Error>>;

    /// A body fed through a one-frame channel: a send completes only when
    /// the body's reader took the frame before.
    fn channel_body() -> (Sender, Body) {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        (tx, Body::new(http_body_util::StreamBody::new(stream)))
    }

    #[tokio::test]
    async fn a_body_dropped_unread_is_drained_in_the_background() {
        let (tx, body) = channel_body();
        drop(Lingering::new(body, 1 << 20, Duration::from_secs(5)));
        // The sender can go on sending: somebody reads what it sends.
        for _ in 0..8 {
            tokio::time::timeout(
                Duration::from_secs(1),
                tx.send(Ok(Frame::data(Bytes::from_static(b"xxxx")))),
            )
            .await
            .expect("the dropped body is still read")
            .expect("the reader is alive");
        }
    }

    #[tokio::test]
    async fn the_drain_stops_at_its_byte_limit() {
        let (tx, body) = channel_body();
        drop(Lingering::new(body, 8, Duration::from_secs(5)));
        let mut sent = 0;
        while sent < 100 {
            let sending = tx.send(Ok(Frame::data(Bytes::from_static(b"xxxx"))));
            if !matches!(
                tokio::time::timeout(Duration::from_millis(500), sending).await,
                Ok(Ok(()))
            ) {
                break;
            }
            sent += 1;
        }
        assert!(sent < 100, "a drain without a limit read {sent} frames");
    }
}
