//! # idemkit-book
//!
//! The guide in `docs/` (built as an mdBook from `book/book.toml`) keeps its Rust
//! snippets honest here: every page with Rust code is included as the docs of a
//! hidden module, so `cargo test -p idemkit-book --doc` compiles each snippet and
//! runs the ones not marked `no_run`. The pages themselves live only in `docs/`
//! (one source, no copies).

#[doc = include_str!("../../docs/getting-started.md")]
mod getting_started {}

#[doc = include_str!("../../docs/server.md")]
mod server {}

#[doc = include_str!("../../docs/stores.md")]
mod stores {}

#[doc = include_str!("../../docs/grpc.md")]
mod grpc {}

#[doc = include_str!("../../docs/client.md")]
mod client {}

#[doc = include_str!("../../docs/redis.md")]
mod redis {}

#[doc = include_str!("../../docs/multi-step.md")]
mod multi_step {}

#[doc = include_str!("../../docs/configuration.md")]
mod configuration {}
