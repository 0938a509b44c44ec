//! `idemkit docs --proxy`: the integrator contract of an API served through
//! `idemkit proxy` (issue 18), from the real binary; and `idemkit docs` with no
//! flags is still exactly the committed `docs/integrator.md`.

use crate::{Run, idemkit};

const INTEGRATOR_MD: &str = include_str!("../../../../docs/integrator.md");

async fn docs(args: &[&str]) -> Run {
    let mut all = vec!["docs".to_owned()];
    all.extend(args.iter().map(|s| s.to_string()));
    let run = idemkit(all).await;
    assert_eq!(run.code, 0, "{run:#?}");
    run
}

/// The text from `heading` to the next `## ` heading.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading} in\n{doc}"));
    let rest = &doc[start + 1..];
    let end = rest[heading.len()..]
        .find("\n## ")
        .map_or(rest.len(), |i| i + heading.len());
    &rest[..end]
}

#[tokio::test]
async fn the_default_output_is_the_committed_integrator_guide() {
    let run = docs(&[]).await;
    assert!(
        run.stdout == INTEGRATOR_MD,
        "docs/integrator.md is stale: run `cargo run -- docs > docs/integrator.md`"
    );
}

#[tokio::test]
async fn the_proxy_contract_states_the_limit_and_parks_unknown_outcomes() {
    let doc = docs(&["--proxy"]).await.stdout;
    assert!(doc.contains("## Behind idemkit proxy"), "{doc}");
    assert!(doc.contains("idempotency_request_parked"), "{doc}");
    for labels_only in [
        "## gRPC",
        "## Examples",
        "order-4711-label",
        "CreateLabel",
        "## Deadlines",
    ] {
        assert!(!doc.contains(labels_only), "{labels_only} in\n{doc}");
    }
    // The generic parts, from the proxy's default policy.
    assert!(doc.contains("## The key") && doc.contains("## Windows") && doc.contains("## Retrying"));
    assert!(doc.contains("replays for **24 h**"), "{doc}");
    assert!(
        doc.contains("| `POST` (any path) | header `Idempotency-Key` |"),
        "{doc}"
    );
    assert!(doc.contains("| `DELETE` (any path) |"), "{doc}");

    let behind = section(&doc, "## Behind idemkit proxy");
    assert!(
        behind.contains("shares no transaction with the upstream's database"),
        "{behind}"
    );
    assert!(
        behind.contains("every POST, PUT, PATCH and DELETE request"),
        "{behind}"
    );
    assert!(behind.contains("`401` `unauthorized`"), "{behind}");
    assert!(behind.contains("forwarded to the upstream as sent"), "{behind}");
    assert!(
        behind.contains("400, 401, 403, 408, 413, 415, 422, 425 and 429"),
        "{behind}"
    );
    assert!(behind.contains("`Idempotent-Replayed: true`") && behind.contains("`Set-Cookie`"));
    assert!(behind.contains("`413` `payload_too_large`") && behind.contains("**1 MiB**"));
    assert!(behind.contains("`/healthz`") && behind.contains("`/_idemkit/metrics`"));
    assert!(behind.contains("**parked for review**"), "{behind}");
    assert!(
        behind.contains("`409` with `code` `idempotency_request_parked`"),
        "{behind}"
    );
    assert!(behind.contains("Do not create a new request with a new key without checking"));
    assert!(behind.contains("idemkit keys list --state parked"), "{behind}");
    assert!(!behind.contains("re-sent to the upstream"), "{behind}");

    let codes = section(&doc, "## Problem codes");
    assert!(
        codes.contains("| `idempotency_request_parked` | 409 | false |"),
        "{codes}"
    );
    assert!(codes.contains("| `unauthorized` | 401 | false |"), "{codes}");
}

#[tokio::test]
async fn a_key_honouring_upstream_gets_the_same_key_again() {
    let doc = docs(&["--proxy", "--upstream-honours-keys"]).await.stdout;
    let behind = section(&doc, "## Behind idemkit proxy");
    assert!(
        behind.contains("**the same key is re-sent to the upstream**"),
        "{behind}"
    );
    assert!(
        behind.contains("the upstream must de-duplicate by key itself"),
        "{behind}"
    );
    assert!(!behind.contains("parked"), "{behind}");
    assert!(
        !doc.contains("idempotency_request_parked"),
        "a key-honouring upstream's requests are never parked:\n{doc}"
    );
    assert!(
        doc.contains("| `internal_error` | 500, 502, 503, 504 | true |"),
        "{doc}"
    );
}

#[tokio::test]
async fn the_proxy_contract_lists_the_configured_routes() {
    let file = std::env::temp_dir().join(format!("idemkit-proxy-docs-{}.toml", std::process::id()));
    std::fs::write(
        &file,
        "[defaults]\nreplay_window = \"2h\"\nmismatch_status = 422\n\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/orders\"\ndescription = \"Place an order.\"\n\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/legacy\"\nretry_safe = false\n\n\
         [[routes]]\nmethod = \"GET\"\npath = \"/orders/{id}\"\n",
    )
    .unwrap();
    let run = docs(&["--proxy", "--config", file.to_str().unwrap()]).await;
    let _ = std::fs::remove_file(&file);
    let doc = run.stdout;
    assert!(
        doc.contains("| `POST /orders` | header `Idempotency-Key` |"),
        "{doc}"
    );
    assert!(doc.contains("`POST /orders`: Place an order."), "{doc}");
    assert!(
        doc.contains("not retry-safe") && doc.contains("- `POST /legacy`"),
        "{doc}"
    );
    assert!(!doc.contains("(any path)"), "{doc}");
    assert!(doc.contains("replays for **2 h**"), "{doc}");
    assert!(
        doc.contains("\"status\": 422, \"code\": \"idempotency_key_reused\""),
        "{doc}"
    );
    let behind = section(&doc, "## Behind idemkit proxy");
    assert!(
        behind.contains("**Keyed routes:** `POST /orders`, matched by method and path (a `{name}` segment"),
        "{behind}"
    );
    assert!(!behind.contains("every POST"), "{behind}");
}

/// The contract publishes what the proxy runs with: its flags, not only their
/// defaults.
#[tokio::test]
async fn the_proxy_contract_follows_the_proxys_flags() {
    let doc = docs(&[
        "--proxy",
        "--account-header",
        "X-Api-Key",
        "--max-request-body",
        "65536",
        "--lease-ms",
        "90000",
    ])
    .await
    .stdout;
    let behind = section(&doc, "## Behind idemkit proxy");
    assert!(behind.contains("`X-Api-Key` header is required"), "{behind}");
    assert!(!behind.contains("`Authorization`"), "{behind}");
    assert!(behind.contains("**64 KiB**"), "{behind}");
    assert!(doc.contains("a lease of **1m 30s**"), "{doc}");
    // The control: the defaults.
    let default = docs(&["--proxy"]).await.stdout;
    assert!(
        default.contains("`Authorization` header is required"),
        "{default}"
    );
    assert!(default.contains("**1 MiB**"), "{default}");
    assert!(default.contains("a lease of **30s**"), "{default}");
}

#[tokio::test]
async fn upstream_honours_keys_requires_proxy() {
    let run = idemkit(vec!["docs".into(), "--upstream-honours-keys".into()]).await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stderr.contains("--proxy"), "{}", run.stderr);
}

/// Issue 34: the contract states each production behaviour in plain words.
#[tokio::test]
async fn the_proxy_contract_states_the_production_behaviours() {
    let doc = docs(&["--proxy"]).await.stdout;
    let behind = section(&doc, "## Behind idemkit proxy");
    for said in [
        "an answered `5xx` is **stored and replayed**",
        "never runs the request a second time",
        "A `502` or `504` (a gateway's answer) is an unknown outcome",
        "So are `404` and `405`",
        "A `Connection` header that names `Authorization` or `Idempotency-Key`",
        "you still get the upstream's answer",
        "`Accept-Encoding: identity`",
        "compressed for you as your own `Accept-Encoding` asks",
        "`idempotency_replay_not_acceptable`",
        "Stored request bodies** are dropped once the answer is stored",
        "`/_idemkit/ready`",
        "`/healthz` is the upstream's",
        "lets the requests in flight finish and store",
    ] {
        assert!(behind.contains(said), "{said:?} missing from\n{behind}");
    }
    assert!(!doc.contains("not stored: retry with the same key"), "{doc}");
    let honours = docs(&["--proxy", "--upstream-honours-keys"]).await.stdout;
    let behind = section(&honours, "## Behind idemkit proxy");
    assert!(
        behind.contains("passed to you with its `Retry-After` and never stored"),
        "{behind}"
    );
    assert!(
        behind.contains("keeps waiting for the upstream's answer a while longer"),
        "{behind}"
    );
}
