//! The integrator contract, generated from the configuration the service runs
//! with and from the client's defaults, so published numbers are running numbers.

use std::fmt::Write;
use std::time::Duration;

use idemkit_client::{Jitter, RetryConfig, TokenBucket};
use idemkit_core::{InFlightBehavior, MAX_KEY_LEN, ServerErrorPolicy};
use idemkit_tower::config::IdemkitConfig;

/// The default configuration: the labels service's own.
pub const DEFAULT_CONFIG: &str = include_str!("../idemkit.toml");

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Markdown.
    #[default]
    Markdown,
    /// A standalone HTML page.
    Html,
}

/// Durations as integrators read them: whole hours or minutes when they are.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() == 0 && secs > 0 && secs.is_multiple_of(3600) {
        format!("{} h", secs / 3600)
    } else if d.subsec_nanos() == 0 && secs > 0 && secs.is_multiple_of(60) {
        format!("{} min", secs / 60)
    } else {
        humantime::format_duration(d).to_string()
    }
}

/// Renders the contract.
pub fn render(config: &IdemkitConfig, client: &RetryConfig, format: Format) -> String {
    let markdown = markdown(config, client);
    match format {
        Format::Markdown => markdown,
        Format::Html => {
            let mut body = String::new();
            pulldown_cmark::html::push_html(
                &mut body,
                pulldown_cmark::Parser::new_ext(&markdown, pulldown_cmark::Options::ENABLE_TABLES),
            );
            format!(
                "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Idempotency contract</title></head>\n<body>\n{body}</body></html>\n"
            )
        }
    }
}

fn markdown(config: &IdemkitConfig, client: &RetryConfig) -> String {
    let d = &config.defaults;
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "# Idempotency contract\n");
    let _ = writeln!(
        w,
        "Retried writes to this API are **effectively once within the key scope and replay window**: \
         at-least-once delivery plus de-duplication by idempotency key. This page is generated from the \
         configuration the service runs with.\n"
    );

    let _ = writeln!(w, "## Routes\n");
    let _ = writeln!(
        w,
        "| route | key | replay status | longest retry chain | on 5xx | while in flight |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|");
    for r in config.routes.iter().filter(|r| r.retry_safe) {
        let p = r.policy();
        let key = match &r.key_field {
            Some(f) => format!("JSON body field `{f}`"),
            None => format!("header `{}`", r.key_header()),
        };
        let replay = p.replay_status.map_or("the stored status".to_owned(), |s| {
            format!("{s} for a stored 2xx")
        });
        let chain = r.longest_retry_chain.map_or("—".to_owned(), human);
        let five = match p.on_server_error {
            ServerErrorPolicy::Replay => "stored and replayed",
            _ => "not stored: retry with the same key",
        };
        let in_flight = match p.in_flight {
            InFlightBehavior::Wait(t) => format!("waits up to {}, then replays or 409", human(t)),
            InFlightBehavior::Accepted => "202 with a status URL".to_owned(),
            _ => "409 `idempotency_request_in_progress` with `Retry-After`".to_owned(),
        };
        let _ = writeln!(
            w,
            "| `{} {}` | {key} | {replay} | {chain} | {five} | {in_flight} |",
            r.method, r.path
        );
    }
    let unsafe_routes: Vec<_> = config.routes.iter().filter(|r| !r.retry_safe).collect();
    if !unsafe_routes.is_empty() {
        let _ = writeln!(
            w,
            "\nThese mutating routes take no key and are **not retry-safe**: do not retry them blindly.\n"
        );
        for r in unsafe_routes {
            let _ = writeln!(w, "- `{} {}`", r.method, r.path);
        }
    }
    for r in config.routes.iter().filter(|r| r.description.is_some()) {
        let _ = writeln!(
            w,
            "\n`{} {}`: {}",
            r.method,
            r.path,
            r.description.as_deref().unwrap_or_default()
        );
    }

    let _ = writeln!(w, "\n## The key\n");
    let _ = writeln!(
        w,
        "- 1 to {MAX_KEY_LEN} visible ASCII characters (0x21–0x7E). The quoted form `\"abc\"` is the same key as `abc`.\n\
         - Scope: **(your account, key)**. Another account's identical key is a different request.\n\
         - Choose keys, best first: derived from the business event (`order-confirm-{{orderId}}`); scoped to the \
         request; a random UUID generated **once** and reused on every retry.\n\
         - Anti-pattern: a new key per attempt (a fresh UUID or a timestamp on each retry) turns every retry into a \
         new request and defeats the mechanism."
    );

    let _ = writeln!(w, "\n## Windows\n");
    let _ = writeln!(
        w,
        "- A completed request replays for **{}** (the replay window). After that, the same key starts a new request.\n\
         - Records are kept **{}** for investigation, without replaying after the window.\n\
         - A request in flight holds its key for a lease of **{}**, extended while it runs; if its server dies, a \
         retry after the lease takes it over and resumes it.",
        human(d.replay_window),
        human(d.reap_threshold),
        human(d.lease)
    );

    let _ = writeln!(w, "\n## Answers\n");
    let _ = writeln!(
        w,
        "- A replay is byte-identical to the first answer and carries `Idempotent-Replayed: true`.\n\
         - Validation errors (`400`) are not stored: fix the request and send it again with the same key.\n\
         - Errors are RFC 9457 problem documents (`application/problem+json`) with a stable `code` and a \
         `retryable` flag.\n"
    );
    let _ = writeln!(w, "The two conflicts have different codes:\n");
    let _ = writeln!(
        w,
        "```json\n{{\"status\": 409, \"code\": \"idempotency_request_in_progress\", \"retryable\": true}}\n```\n\n\
         The first request with this key is still running: retry after `Retry-After` seconds.\n\n\
         ```json\n{{\"status\": {}, \"code\": \"idempotency_key_reused\", \"retryable\": false}}\n```\n\n\
         This key was used with a different request: a client bug. Do not retry; use a new key for a new request.",
        d.mismatch_status
    );

    let _ = writeln!(w, "\n## Retrying\n");
    let base = client.backoff().base();
    let cap = client.backoff().cap();
    let jitter = match client.backoff().jitter() {
        Jitter::Full => "full jitter: sleep = random(0, min(cap, base·2^n))",
        _ => "decorrelated jitter",
    };
    let deadline = client.deadline().map_or("none".to_owned(), human);
    let _ = writeln!(
        w,
        "Retry only connection failures, `429`, `502`, `503`, `504` and `409 idempotency_request_in_progress`, \
         honouring `Retry-After`. The Rust client `idemkit-client` does this by default: **{} attempts** in total, \
         **{jitter}**, base **{}**, cap **{}** (throttling answers start from **{}**), one overall deadline of \
         **{deadline}**, and a retry budget of **{} tokens** shared by all calls ({} per transient retry, {} per \
         throttled retry, refunded on success).\n",
        client.max_attempts(),
        human(base),
        human(cap),
        human(client.throttling_backoff().base()),
        TokenBucket::DEFAULT_CAPACITY,
        TokenBucket::DEFAULT_TRANSIENT_COST,
        TokenBucket::DEFAULT_THROTTLING_COST
    );
    let _ = writeln!(w, "A worked schedule for a call that keeps failing with `503`:\n");
    let _ = writeln!(w, "| attempt | starts after a sleep drawn from |");
    let _ = writeln!(w, "|---|---|");
    let _ = writeln!(w, "| 1 | — (sent at once) |");
    for n in 1..client.max_attempts() {
        let ceiling = client.backoff().ceiling(n - 1, Duration::ZERO);
        let _ = writeln!(w, "| {} | 0 – {} |", n + 1, human(ceiling));
    }
    let _ = writeln!(
        w,
        "\nThen the call returns its last error. Other languages: use a maintained retry library configured the \
         same way and reuse the key on every attempt — tenacity (Python), Resilience4j (Java), Polly (.NET), \
         cockatiel (TypeScript), cenkalti/backoff (Go)."
    );

    let _ = writeln!(w, "\n## OpenAPI fragment\n");
    let _ = writeln!(
        w,
        "```json\n{}\n```",
        serde_json::to_string_pretty(&openapi_fragment(config)).unwrap_or_default()
    );
    out
}

/// The key header parameter and the problem responses, for merging into a
/// service's OpenAPI document.
pub fn openapi_fragment(config: &IdemkitConfig) -> serde_json::Value {
    serde_json::json!({
        "components": {
            "parameters": {
                "IdempotencyKey": {
                    "name": config.defaults.key_header, "in": "header", "required": true,
                    "description": format!("1–{MAX_KEY_LEN} visible ASCII characters, scoped to the caller's account; replays for {}.", human(config.defaults.replay_window)),
                    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LEN}
                }
            },
            "responses": {
                "IdempotencyKeyReused": {"description": "The key was used with a different request (`idempotency_key_reused`).",
                    "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}},
                "IdempotencyRequestInProgress": {"description": "A request with this key is in progress (`idempotency_request_in_progress`); honour `Retry-After`.",
                    "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                    "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}}
            }
        }
    })
}

/// The labels service's configuration.
pub fn default_config() -> IdemkitConfig {
    IdemkitConfig::from_toml(DEFAULT_CONFIG)
        .unwrap_or_else(|e| unreachable!("the shipped configuration is valid: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contract_follows_the_configuration() {
        let doc = render(&default_config(), &RetryConfig::new(), Format::Markdown);
        assert!(doc.contains("replays for **24 h**"), "{doc}");
        assert!(doc.contains("kept **72 h**"));
        assert!(doc.contains("lease of **30s**"));
        assert!(doc.contains("200 for a stored 2xx"));
        assert!(doc.contains("\"status\": 409, \"code\": \"idempotency_key_reused\""));
        assert!(doc.contains("**3 attempts**"));
        assert!(doc.contains("| 3 | 0 – 100ms |"));

        let changed = IdemkitConfig::from_toml(
            "[defaults]\nreplay_window = \"2h\"\nreap_threshold = \"6h\"\nmismatch_status = 422\n\
             [[routes]]\nmethod = \"POST\"\npath = \"/labels\"\nkey_field = \"/idempotencyKey\"\n\
             [[routes]]\nmethod = \"POST\"\npath = \"/legacy\"\nretry_safe = false\n",
        )
        .unwrap();
        let client =
            RetryConfig::new()
                .with_max_attempts(5)
                .with_backoff(idemkit_client::Backoff::full_jitter(
                    Duration::from_millis(100),
                    Duration::from_secs(1),
                ));
        let doc = render(&changed, &client, Format::Markdown);
        assert!(doc.contains("replays for **2 h**"), "{doc}");
        assert!(doc.contains("kept **6 h**"));
        assert!(doc.contains("\"status\": 422, \"code\": \"idempotency_key_reused\""));
        assert!(
            doc.contains("| the stored status |"),
            "no replay status override any more"
        );
        assert!(doc.contains("**5 attempts**"));
        assert!(doc.contains("| 5 | 0 – 800ms |"));
        assert!(doc.contains("not retry-safe") && doc.contains("`POST /legacy`"));

        let html = render(&changed, &client, Format::Html);
        assert!(html.starts_with("<!doctype html>") && html.contains("<table>"));
    }
}
