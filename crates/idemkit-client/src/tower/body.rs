use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Empty, Full};

/// A request body that may be sent more than once.
///
/// Implemented for in-memory bodies. Implement it for your own body type; return
/// `None` for bodies that cannot be replayed (streams), and such requests are sent
/// once, never retried.
pub trait ReplayBody: Sized {
    /// A copy to send on another attempt, or `None` when the body cannot be replayed.
    fn try_clone_body(&self) -> Option<Self>;
}

impl ReplayBody for Full<Bytes> {
    fn try_clone_body(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl ReplayBody for Empty<Bytes> {
    fn try_clone_body(&self) -> Option<Self> {
        Some(Self::new())
    }
}

impl ReplayBody for String {
    fn try_clone_body(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl ReplayBody for Bytes {
    fn try_clone_body(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl ReplayBody for Vec<u8> {
    fn try_clone_body(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<D, E> ReplayBody for http_body_util::combinators::BoxBody<D, E> {
    fn try_clone_body(&self) -> Option<Self> {
        None
    }
}

impl<D, E> ReplayBody for http_body_util::combinators::UnsyncBoxBody<D, E> {
    fn try_clone_body(&self) -> Option<Self> {
        None
    }
}

/// The response body of a [`RetryService`](super::RetryService): the inner body,
/// or the buffered bytes of a `409` problem document that was read to classify it.
#[derive(Debug)]
pub struct RetryBody<B> {
    kind: Kind<B>,
}

#[derive(Debug)]
enum Kind<B> {
    Streaming(Pin<Box<B>>),
    Buffered(Option<Bytes>),
}

impl<B> RetryBody<B> {
    pub(super) fn streaming(body: B) -> Self {
        Self {
            kind: Kind::Streaming(Box::pin(body)),
        }
    }

    pub(super) fn buffered(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Buffered(Some(bytes).filter(|b| !b.is_empty())),
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RetryBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match &mut self.get_mut().kind {
            Kind::Streaming(body) => body.as_mut().poll_frame(cx),
            Kind::Buffered(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Streaming(body) => body.is_end_stream(),
            Kind::Buffered(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Streaming(body) => body.size_hint(),
            Kind::Buffered(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}
