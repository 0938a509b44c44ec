//! Reading the start of a body without losing any of it: what was read is handed on
//! first, then the rest of the body, or the failure that ended the read.
//!
//! A `409` is read to find its problem `code`, and a gRPC request to see whether it
//! is one complete message. Neither read may turn the body into something else: a
//! body too large to classify goes on whole (the bytes read, then the rest), a body
//! whose read failed goes on as that failure, never as an empty or cut answer.

// The gRPC layer uses only the prefix-and-rest shape; the HTTP layers use the rest.
#![cfg_attr(not(any(feature = "reqwest", feature = "tower")), allow(dead_code))]

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

/// A body that yields buffered chunks, then its tail.
pub(crate) struct Replayed<B: Body> {
    chunks: VecDeque<Bytes>,
    tail: Tail<B>,
}

enum Tail<B: Body> {
    /// The body is still streaming after the buffered chunks.
    Rest(Pin<Box<B>>),
    /// The body ended (with these trailers, if any).
    End(Option<HeaderMap>),
    /// The body failed after the buffered chunks (the error, until yielded).
    Failed(Option<Box<B::Error>>),
}

/// What [`read_start`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Peek {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// More than the limit: the rest is still in the body.
    TooLarge,
    /// The read failed.
    Failed,
}

impl<B: Body> fmt::Debug for Replayed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tail = match &self.tail {
            Tail::Rest(_) => "rest",
            Tail::End(_) => "end",
            Tail::Failed(_) => "failed",
        };
        f.debug_struct("Replayed")
            .field("buffered", &self.chunks.iter().map(Bytes::len).sum::<usize>())
            .field("tail", &tail)
            .finish()
    }
}

impl<B: Body> Replayed<B> {
    /// A body that has ended: `bytes`, then `trailers`.
    pub(crate) fn whole(bytes: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            chunks: std::iter::once(bytes).filter(|b| !b.is_empty()).collect(),
            tail: Tail::End(trailers),
        }
    }

    /// `prefix`, then whatever is left of `rest`.
    #[cfg(feature = "tonic")]
    pub(crate) fn prefixed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            chunks: std::iter::once(prefix).filter(|b| !b.is_empty()).collect(),
            tail: Tail::Rest(rest),
        }
    }

    /// Takes the failure out of a body whose read failed (the caller hands it on
    /// itself, e.g. as a transport error).
    #[cfg(feature = "reqwest")]
    pub(crate) fn take_error(&mut self) -> Option<B::Error> {
        match &mut self.tail {
            Tail::Failed(err) => err.take().map(|e| *e),
            _ => None,
        }
    }

    fn buffered(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }
}

/// Reads `body` until it ends, fails or has given more than `limit` bytes.
pub(crate) async fn read_start<B>(body: B, limit: usize) -> (Replayed<B>, Peek)
where
    B: Body<Data = Bytes>,
{
    let mut body = Box::pin(body);
    let mut chunks: VecDeque<Bytes> = VecDeque::new();
    let mut len = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    loop {
        match body.frame().await {
            None => {
                let mut whole = BytesMut::with_capacity(len);
                for chunk in chunks.iter() {
                    whole.extend_from_slice(chunk);
                }
                let whole = whole.freeze();
                return (Replayed::whole(whole.clone(), trailers), Peek::Whole(whole));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    len += data.len();
                    chunks.push_back(data);
                    if len > limit {
                        let replayed = Replayed {
                            chunks,
                            tail: Tail::Rest(body),
                        };
                        return (replayed, Peek::TooLarge);
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        match &mut trailers {
                            Some(all) => all.extend(t),
                            None => trailers = Some(t),
                        }
                    }
                }
            },
            Some(Err(err)) => {
                let replayed = Replayed {
                    chunks,
                    tail: Tail::Failed(Some(Box::new(err))),
                };
                return (replayed, Peek::Failed);
            }
        }
    }
}

impl<B: Body<Data = Bytes>> Body for Replayed<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if let Some(chunk) = this.chunks.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        match &mut this.tail {
            Tail::Rest(body) => body.as_mut().poll_frame(cx),
            Tail::End(trailers) => Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t)))),
            Tail::Failed(err) => Poll::Ready(err.take().map(|e| Err(*e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
            && match &self.tail {
                Tail::Rest(body) => body.is_end_stream(),
                Tail::End(trailers) => trailers.is_none(),
                Tail::Failed(err) => err.is_none(),
            }
    }

    fn size_hint(&self) -> SizeHint {
        let buffered = self.buffered();
        match &self.tail {
            Tail::Rest(body) => {
                let rest = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(buffered));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(buffered));
                }
                hint
            }
            Tail::End(_) => SizeHint::with_exact(buffered),
            Tail::Failed(_) => {
                let mut hint = SizeHint::new();
                hint.set_lower(buffered);
                hint
            }
        }
    }
}
