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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    fn docs() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
    }

    /// The book links to every page of `docs/`: a page missing from SUMMARY.md
    /// would be built by nobody and found by no reader.
    #[test]
    fn the_summary_lists_every_page() {
        let summary = std::fs::read_to_string(docs().join("SUMMARY.md")).expect("docs/SUMMARY.md");
        let linked: BTreeSet<&str> = summary
            .split("](")
            .skip(1)
            .filter_map(|rest| rest.split(')').next())
            .collect();
        let mut missing = Vec::new();
        for entry in std::fs::read_dir(docs()).expect("docs/") {
            let name = entry
                .expect("a docs/ entry")
                .file_name()
                .into_string()
                .expect("UTF-8 name");
            if name.ends_with(".md") && name != "SUMMARY.md" && !linked.contains(name.as_str()) {
                missing.push(name);
            }
        }
        assert!(missing.is_empty(), "docs/SUMMARY.md does not link {missing:?}");
    }

    /// Getting started shows the README's example program verbatim.
    #[test]
    fn getting_started_shows_the_readme_example() {
        let page = std::fs::read_to_string(docs().join("getting-started.md")).expect("the page");
        let example = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/idemkit/examples/readme.rs"),
        )
        .expect("the example");
        assert!(
            page.contains(&format!("```rust,no_run\n{example}```")),
            "docs/getting-started.md must show crates/idemkit/examples/readme.rs verbatim"
        );
    }
}
