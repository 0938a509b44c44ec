use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Empty, Full};

use crate::replay::Replayed;

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
/// or a `409` problem document that was read to classify it, handed on whole: the
/// bytes read, then the rest of a body too large to classify, or the failure that
/// ended the read (never an empty or cut body passed off as the answer).
pub struct RetryBody<B: Body> {
    kind: Kind<B>,
}

enum Kind<B: Body> {
    Streaming(Pin<Box<B>>),
    Replayed(Replayed<B>),
}

impl<B: Body> std::fmt::Debug for RetryBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Streaming(_) => f.write_str("RetryBody::Streaming"),
            Kind::Replayed(r) => f.debug_tuple("RetryBody::Replayed").field(r).finish(),
        }
    }
}

impl<B: Body> RetryBody<B> {
    pub(super) fn streaming(body: B) -> Self {
        Self {
            kind: Kind::Streaming(Box::pin(body)),
        }
    }

    pub(super) fn replayed(body: Replayed<B>) -> Self {
        Self {
            kind: Kind::Replayed(body),
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
            Kind::Replayed(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Streaming(body) => body.is_end_stream(),
            Kind::Replayed(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Streaming(body) => body.size_hint(),
            Kind::Replayed(body) => body.size_hint(),
        }
    }
}
