//! The integrator contract, generated from the configuration the service runs
//! with and from the client's defaults, so published numbers are running numbers.

use std::fmt::Write;
use std::time::Duration;

use idemkit_client::{Jitter, RetryConfig, TokenBucket};
use idemkit_core::{ErrorCode, InFlightBehavior, MAX_KEY_LEN, Policy, ServerErrorPolicy};
use idemkit_tower::config::{IdemkitConfig, RouteConfig};
use idemkit_tower::engine::{Disposition, Outcome};
use serde_json::{Value, json};

mod grpc;
mod proxy;

pub use proxy::{PROXY_DEFAULT_METHODS, ProxyContract, render_proxy};

/// The REST deadline header as the contract spells it (the wire name is
/// [`idemkit_core::DEADLINE_HEADER`], case-insensitive).
pub(crate) const DEADLINE_HEADER_DISPLAY: &str = "Request-Timeout";

/// The default configuration: the labels service's own.
pub const DEFAULT_CONFIG: &str = include_str!("../../idemkit.toml");

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
    in_format(markdown(config, client), format)
}

/// The Markdown as `format` asks.
fn in_format(markdown: String, format: Format) -> String {
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

/// One keyed route as the `## Routes` table shows it.
struct KeyedRoute {
    /// `` `POST /labels` ``, or `` `POST` (any path) ``.
    route: String,
    /// Where the key travels.
    key: String,
    /// The route's effective policy.
    policy: Policy,
}

impl KeyedRoute {
    fn of(r: &RouteConfig) -> Self {
        Self {
            route: format!("`{} {}`", r.method, r.path),
            key: match &r.key_field {
                Some(f) => format!("JSON body field `{f}`"),
                None => format!("header `{}`", r.key_header()),
            },
            policy: r.policy(),
        }
    }
}

/// The `## Routes` table. Behind the proxy, `accepted` answers as in progress
/// (there is no status URL to send).
fn routes_table(w: &mut String, routes: &[KeyedRoute], proxy: bool) {
    let _ = writeln!(w, "## Routes\n");
    let _ = writeln!(
        w,
        "| route | key | replay status | longest retry chain | on 5xx | while in flight |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|");
    for r in routes {
        let p = &r.policy;
        let replay = p.replay_status.map_or("the stored status".to_owned(), |s| {
            format!("{s} for a stored 2xx")
        });
        let chain = p.longest_retry_chain.map_or("—".to_owned(), human);
        let five = match p.on_server_error {
            ServerErrorPolicy::Replay => "stored and replayed",
            _ => "not stored: retry with the same key",
        };
        let in_flight = match p.in_flight {
            InFlightBehavior::Wait(t) => format!("waits up to {}, then replays or 409", human(t)),
            InFlightBehavior::Accepted if !proxy => "202 with a status URL".to_owned(),
            _ => "409 `idempotency_request_in_progress` with `Retry-After`".to_owned(),
        };
        let _ = writeln!(
            w,
            "| {} | {} | {replay} | {chain} | {five} | {in_flight} |",
            r.route, r.key
        );
    }
}

/// The routes of `config` that take no key, and the sentences describing routes.
fn unkeyed_and_descriptions(w: &mut String, config: &IdemkitConfig) {
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
}

/// The `## The key` section; `scope` is its scope bullet.
fn the_key(w: &mut String, scope: &str) {
    let _ = writeln!(w, "\n## The key\n");
    let _ = writeln!(
        w,
        "- 1 to {MAX_KEY_LEN} visible ASCII characters (0x21–0x7E). The quoted form `\"abc\"` is the same key as `abc`.\n\
         {scope}\n\
         - One key is one request: the same method, path, **query string** and body. JSON member order, whitespace \
         and string escapes do not matter; numbers are compared digit for digit (`1` and `1.0` differ), and so is \
         the query string (`?amount=5` and `?amount=500` differ; so does a different parameter order). Anything \
         else under the same key is `idempotency_key_reused`.\n\
         - Choose keys, best first: derived from the business event (`order-confirm-{{orderId}}`); scoped to the \
         request; a random UUID generated **once** and reused on every retry.\n\
         - Anti-pattern: a new key per attempt (a fresh UUID or a timestamp on each retry) turns every retry into a \
         new request and defeats the mechanism."
    );
}

/// The `## Windows` section; `takeover` says what a retry does with a request
/// whose server died.
fn windows(w: &mut String, policy: &Policy, takeover: &str) {
    let _ = writeln!(w, "\n## Windows\n");
    let _ = writeln!(
        w,
        "- A completed request replays for **{}** (the replay window). After that, the same key starts a new request.\n\
         - Records are kept **{}** for investigation, without replaying after the window.\n\
         - A request in flight holds its key for a lease of **{}**, extended while it runs; {takeover}.\n\
         - The window applies to completed requests only: a request that never finished is resumed (or held for \
         review) however old it is; it never starts over as a new request.\n\
         - **If you hang up mid-request, the request still runs to its end.** Closing the connection (a client \
         timeout) does not cancel it: retry with the same key and you get its one result (`409 \
         idempotency_request_in_progress` while it runs, then the stored answer), never a second execution.",
        human(policy.replay_window),
        human(policy.reap_threshold),
        human(policy.lease)
    );
}

/// The `## Answers` section; `validation` is its bullet on validation errors.
fn answers(w: &mut String, validation: &str, mismatch_status: u16) {
    let _ = writeln!(w, "\n## Answers\n");
    let _ = writeln!(
        w,
        "- A replay is byte-identical to the first answer and carries `Idempotent-Replayed: true`.\n\
         {validation}\n\
         - Errors are RFC 9457 problem documents (`application/problem+json`) with a stable `code` and a \
         `retryable` flag.\n"
    );
    let _ = writeln!(w, "The two conflicts have different codes:\n");
    let _ = writeln!(
        w,
        "```json\n{{\"status\": {}, \"code\": \"{}\", \"retryable\": {}}}\n```\n\n\
         The first request with this key is still running: retry after `Retry-After` seconds. The hint is the \
         expected wait (at most a third of the lease), not the whole lease, so a client with a short deadline can \
         still wait for the answer.\n\n\
         ```json\n{{\"status\": {mismatch_status}, \"code\": \"{}\", \"retryable\": {}}}\n```\n\n\
         This key was used with a different request: a client bug. Do not retry; use a new key for a new request.",
        ErrorCode::RequestInProgress.default_status(),
        ErrorCode::RequestInProgress,
        ErrorCode::RequestInProgress.retryable(),
        ErrorCode::KeyReused,
        ErrorCode::KeyReused.retryable(),
    );
}

/// The `## Retrying` section: the client's defaults and a worked schedule.
fn retrying(w: &mut String, client: &RetryConfig) {
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
         honouring `Retry-After` up to a cap (a longer hint ends the retries and hands you the answer with it). A \
         `502` or `504`, or a timeout after the request was sent, may mean the request ran: retry those only with \
         the same idempotency key. The Rust client `idemkit-client` does this by default (Retry-After cap **{}**): \
         **{} attempts** in total, \
         **{jitter}**, base **{}**, cap **{}** (throttling answers start from **{}**), one overall deadline of \
         **{deadline}**, and a retry budget of **{} tokens** shared by all calls ({} per transient retry, {} per \
         throttled retry, refunded on success).\n",
        human(client.retry_after_cap()),
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
}

/// The policy every route of `config` starts from (its windows and mismatch status).
fn defaults_policy(config: &IdemkitConfig) -> Policy {
    let d = &config.defaults;
    Policy::new()
        .with_replay_window(d.replay_window)
        .with_reap_threshold(d.reap_threshold)
        .with_lease(d.lease)
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

    let keyed: Vec<_> = config
        .routes
        .iter()
        .filter(|r| r.retry_safe)
        .map(KeyedRoute::of)
        .collect();
    routes_table(w, &keyed, false);
    unkeyed_and_descriptions(w, config);
    the_key(
        w,
        "- Scope: **(your account, key)**. Another account's identical key is a different request.",
    );
    windows(
        w,
        &defaults_policy(config),
        "if its server dies, a retry after the lease takes it over and resumes it",
    );
    answers(
        w,
        "- Validation errors (`400`) are not stored: fix the request and send it again with the same key.",
        d.mismatch_status,
    );
    retrying(w, client);

    deadlines(w);

    let _ = writeln!(w, "\n## Examples\n");
    let _ = writeln!(
        w,
        "Each keyed route, with commands to paste (set `BASE` to the service's URL and `TOKEN` to your bearer \
         token). Running them in order shows the four answers a retrying client meets."
    );
    for r in config.routes.iter().filter(|r| r.retry_safe) {
        examples(w, r);
    }

    // gRPC serves `CreateLabel` under the policy of `POST /labels`.
    if let Some(r) = config.route("POST", "/labels") {
        grpc::section(w, r);
    }

    let _ = writeln!(w, "\n## Policy as data\n");
    let _ = writeln!(
        w,
        "The policy above is also published for programs: every keyed operation of `GET /openapi.json` carries \
         it as an `x-idempotency` object, and `GET /docs/idempotency.json` serves it for every route, generated \
         from the same configuration (the vocabulary is specified in idemkit's `docs/x-idempotency.md`). \
         `idemkit lint-openapi` reads it, `idemkit check --policy` compares it with what the service does, and \
         `idemkit_client::PublishedPolicy` tells a client where each operation's key goes."
    );

    let _ = writeln!(w, "\n## OpenAPI fragment\n");
    let _ = writeln!(
        w,
        "Each route with its key where it really travels (a header parameter, or a required member of the JSON \
         body), its `x-idempotency` and the conflict responses, for merging into an OpenAPI document:\n"
    );
    let _ = writeln!(
        w,
        "```json\n{}\n```",
        serde_json::to_string_pretty(&openapi_fragment(config)).unwrap_or_default()
    );
    out
}

/// The `## Deadlines` section (issue 15).
fn deadlines(w: &mut String) {
    let _ = writeln!(w, "\n## Deadlines\n");
    let _ = writeln!(
        w,
        "Tell the service how long you are still willing to wait with \
         `{DEADLINE_HEADER_DISPLAY}: <milliseconds>`: the time left of your deadline, in whole milliseconds \
         (1 to {} digits, no unit; round down). It is relative on purpose, so clock skew between you and the \
         service does not matter; the service counts it from the moment your request arrives. Send it again on \
         every retry with what is left then.\n\n\
         - **Already spent** (`{DEADLINE_HEADER_DISPLAY}: 0`, or gone by the time the request arrives): `504` \
         with `code` `deadline_exceeded` and `retryable: false`. Nothing ran and the key was **not** claimed: a \
         later call with a fresh budget may use the same key.\n\
         - **Otherwise** the request runs, and the remaining time is handed to the handler, which can pass it on \
         to its own downstream calls. A request is not cut short when your deadline passes: like a request whose \
         client hung up, it runs to its end and a retry with the same key gets its one result.\n\
         - A malformed value (a sign, a fraction, a unit, more than {} digits) is ignored: the request has no \
         deadline.\n\
         - Over gRPC the deadline is the standard `grpc-timeout` your gRPC library sends from the call's \
         deadline; one already spent is answered with `DEADLINE_EXCEEDED` and a `google.rpc.ErrorInfo` whose \
         `reason` is `deadline_exceeded`, again before the key is claimed.",
        idemkit_core::DEADLINE_HEADER_MAX_DIGITS,
        idemkit_core::DEADLINE_HEADER_MAX_DIGITS,
    );
}

/// A valid request body for a route, for the examples: the labels contract's own
/// for `POST /labels`, otherwise an empty object (plus the key, where it travels
/// in the body).
pub fn example_body(route: &RouteConfig) -> Value {
    if route.method == "POST" && route.path == "/labels" {
        json!({
            "courier": "ups",
            "shipFrom": {"name": "Warehouse", "line1": "1-2-3 Minato", "city": "Tokyo", "postalCode": "105-0001", "country": "JP"},
            "shipTo": {"name": "Ada", "line1": "10 Downing St", "city": "London", "postalCode": "SW1A 2AA", "country": "GB"},
            "parcel": {"weightGrams": 900, "lengthCm": 20, "widthCm": 10, "heightCm": 5}
        })
    } else {
        json!({})
    }
}

/// The body with `key` set where the route reads it (a body route), and the
/// headers that carry it (a header route).
fn keyed(route: &RouteConfig, body: &Value, key: &str) -> (Value, Vec<String>) {
    let mut body = body.clone();
    match &route.key_field {
        Some(pointer) => {
            let name = pointer
                .trim_start_matches('/')
                .replace("~1", "/")
                .replace("~0", "~");
            if let Some(obj) = body.as_object_mut() {
                // The key first, as integrators read it.
                let mut with_key = serde_json::Map::new();
                with_key.insert(name, json!(key));
                with_key.extend(std::mem::take(obj));
                *obj = with_key;
            }
            (body, Vec::new())
        }
        None => (body, vec![format!("{}: {key}", route.key_header())]),
    }
}

/// The body with its first string member changed (a different request).
fn changed(body: &Value) -> Value {
    let mut body = body.clone();
    if let Some(obj) = body.as_object_mut() {
        if let Some(Value::String(s)) = obj.get_mut("courier") {
            *s = "dhl".into();
        } else {
            obj.insert("note".into(), json!("a different request"));
        }
    }
    body
}

/// One `curl` command.
fn curl(route: &RouteConfig, headers: &[String], body: &Value) -> String {
    let mut cmd = format!(
        "curl -i -X {} \"$BASE{}\" \\\n  -H \"Authorization: Bearer $TOKEN\" -H 'Content-Type: application/json'",
        route.method, route.path
    );
    for h in headers {
        cmd.push_str(&format!(" -H '{h}'"));
    }
    cmd.push_str(&format!(" \\\n  -d '{body}'"));
    cmd
}

/// The four answers of one route: first request, replay, mismatch, in progress.
fn examples(w: &mut String, r: &RouteConfig) {
    let p = r.policy();
    let where_key = match &r.key_field {
        Some(f) => format!("in the JSON body field `{f}`"),
        None => format!("in the `{}` header", r.key_header()),
    };
    let body = example_body(r);
    let (first, headers) = keyed(r, &body, "order-4711-label");
    let (other, _) = keyed(r, &changed(&body), "order-4711-label");
    let replay = p.replay_status.map_or_else(
        || "the stored status".to_owned(),
        |s| format!("`{s}` (for a stored 2xx)"),
    );
    let _ = writeln!(w, "\n### `{} {}`\n", r.method, r.path);
    let _ = writeln!(w, "The key travels {where_key}.\n");
    let _ = writeln!(w, "1. First request: runs and answers its own status.\n");
    let _ = writeln!(w, "```sh\n{}\n```\n", curl(r, &headers, &first));
    let _ = writeln!(
        w,
        "2. Replay: the very same command again. Nothing runs again; the answer is the stored one, byte for byte, \
         with {replay} and `Idempotent-Replayed: true`.\n"
    );
    let _ = writeln!(
        w,
        "3. Mismatch: the same key with a different body answers `{} idempotency_key_reused`; nothing runs. Use a \
         new key for a new request.\n",
        p.mismatch_status.as_u16()
    );
    let _ = writeln!(w, "```sh\n{}\n```\n", curl(r, &headers, &other));
    let (fresh, fresh_headers) = keyed(r, &body, "order-4712-label");
    let _ = writeln!(
        w,
        "4. In progress: two identical requests with a fresh key at once. One runs; while it does, the other {}.\n",
        match p.in_flight {
            InFlightBehavior::Wait(t) => format!(
                "waits up to {} for its answer, then replays it (or gets `409`)",
                human(t)
            ),
            InFlightBehavior::Accepted => "gets `202` with a status URL".to_owned(),
            _ =>
                "gets `409 idempotency_request_in_progress` with `Retry-After`: retry after that many seconds"
                    .to_owned(),
        }
    );
    let one = curl(r, &fresh_headers, &fresh);
    let _ = writeln!(w, "```sh\n{one} &\n{one}\nwait\n```");
}

/// Each route with its key where it really travels (a header parameter, or a
/// required member of the JSON body), its `x-idempotency`, and the conflict
/// responses, for merging into a service's OpenAPI document.
pub fn openapi_fragment(config: &IdemkitConfig) -> Value {
    let mut paths = serde_json::Map::new();
    let mut needs_422 = false;
    for r in &config.routes {
        let x = r.x_idempotency();
        let mut op = json!({ "x-idempotency": x });
        if r.retry_safe {
            let p = r.policy();
            let key_schema = json!({"type": "string", "minLength": 1, "maxLength": MAX_KEY_LEN,
                "description": format!("The idempotency key: 1–{MAX_KEY_LEN} visible ASCII characters, scoped to the caller's account; replays for {}.", human(p.replay_window))});
            match &r.key_field {
                Some(pointer) => {
                    let name = pointer.trim_start_matches('/');
                    op["requestBody"] = json!({"required": true, "content": {"application/json": {"schema":
                        {"type": "object", "required": [name], "properties": {name: key_schema}}}}});
                }
                None => {
                    op["parameters"] = json!([{"name": r.key_header(), "in": "header", "required": true, "schema": key_schema}]);
                }
            }
            let mut responses = json!({
                "2XX": {"description": "The answer; a replay is the stored answer, byte-identical, with `Idempotent-Replayed: true`.",
                    "headers": {"Idempotent-Replayed": {"$ref": "#/components/headers/IdempotentReplayed"}}},
                "400": {"$ref": "#/components/responses/IdempotencyKeyMissingOrInvalid"},
                "409": {"$ref": "#/components/responses/IdempotencyConflict"},
            });
            if p.mismatch_status.as_u16() == 422 {
                needs_422 = true;
                responses["422"] = json!({"$ref": "#/components/responses/IdempotencyKeyReused"});
            }
            if let Some(s) = p.replay_status {
                responses[s.to_string()] = json!({"description": "A replay of a stored 2xx answer.",
                    "headers": {"Idempotent-Replayed": {"$ref": "#/components/headers/IdempotentReplayed"}}});
            }
            op["responses"] = responses;
        }
        let item = paths.entry(r.path.clone()).or_insert_with(|| json!({}));
        item[r.method.to_ascii_lowercase()] = op;
    }
    let problem = json!({"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}});
    let mut responses = json!({
        "IdempotencyKeyMissingOrInvalid": {"description": "No key (`idempotency_key_missing`) or a malformed one (`idempotency_key_invalid`); nothing was stored.", "content": problem},
        "IdempotencyConflict": {"description": "`idempotency_key_reused`: the key was used with a different request; or `idempotency_request_in_progress`: the first request with this key is still running, retry after `Retry-After`.",
            "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds, on `idempotency_request_in_progress`."}},
            "content": problem},
    });
    if needs_422 {
        responses["IdempotencyKeyReused"] = json!({"description": "The key was used with a different request (`idempotency_key_reused`).", "content": problem});
    }
    json!({
        "paths": paths,
        "components": {
            "headers": {"IdempotentReplayed": {"description": "`true` on a replayed answer.", "schema": {"type": "string", "enum": ["true"]}}},
            "responses": responses,
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
    fn the_examples_are_valid_requests_and_the_fragment_keys_the_body() {
        let config = default_config();
        let route = config.route("POST", "/labels").unwrap();
        let (first, headers) = keyed(route, &example_body(route), "order-4711-label");
        assert!(headers.is_empty(), "the labels key travels in the body");
        crate::service::CreateLabel::parse(first.to_string().as_bytes()).expect("the first example is valid");
        let (other, _) = keyed(route, &changed(&example_body(route)), "order-4711-label");
        crate::service::CreateLabel::parse(other.to_string().as_bytes())
            .expect("the mismatch example is valid");
        assert_ne!(first, other);

        let fragment = openapi_fragment(&config);
        let op = &fragment["paths"]["/labels"]["post"];
        assert!(
            op.get("parameters").is_none(),
            "no Idempotency-Key header for a body-keyed route"
        );
        assert_eq!(
            op["requestBody"]["content"]["application/json"]["schema"]["required"],
            json!(["idempotencyKey"])
        );
        assert_eq!(op["x-idempotency"], route.x_idempotency());
        let doc = render(&config, &RetryConfig::new(), Format::Markdown);
        assert!(
            doc.contains("`Idempotent-Replayed: true`")
                && doc.contains("\"idempotencyKey\":\"order-4711-label\"")
        );
    }

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
        assert!(doc.contains("## Deadlines") && doc.contains("`Request-Timeout: <milliseconds>`"));
        assert!(doc.contains("`504` with `code` `deadline_exceeded`"));
        assert!(DEADLINE_HEADER_DISPLAY.eq_ignore_ascii_case(idemkit_core::DEADLINE_HEADER));

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
        assert!(
            doc.contains("| `idempotency_key_reused` | 422 |"),
            "the gRPC table follows the configured mismatch status"
        );
    }
}
