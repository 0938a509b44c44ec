//! The HTTP renderings the layer answers with, for an HTTP adapter of one's own
//! in front of the same store (`idemkit proxy` is one): a stored answer
//! replayed faithfully and negotiated against the caller's `Accept-Encoding`,
//! and a request body read under a cap. The engine underneath is
//! [`idemkit_engine`].

pub use crate::conventions::accepts_encoding;
pub use crate::response::{replay_response, replay_response_to};
pub use crate::service::read_body;
