//! # idemkit-contract
//!
//! The integrator contract of an idempotent API, generated from the configuration
//! it runs with ([`IdemkitConfig`]) and from the client's retry defaults, so the
//! numbers an integrator reads are the running numbers: Markdown, a styled HTML
//! page, the policy as JSON, the `x-idempotency` OpenAPI extension and an OpenAPI
//! fragment, and an axum [`router`] that serves `/docs/idempotency` and
//! `/docs/idempotency.json` from the running configuration.
//!
//! ```
//! use idemkit_contract::{Contract, Format};
//! use idemkit_tower::config::IdemkitConfig;
//!
//! let config = IdemkitConfig::from_toml(
//!     "[[routes]]\nmethod = \"POST\"\npath = \"/orders\"\n",
//! )?;
//! let contract = Contract::new(config);
//! let page = contract.render(Format::Markdown);
//! assert!(page.contains("`POST /orders`"));
//! assert!(page.contains("effectively once within the key scope and replay window"));
//!
//! // Serve it beside your own routes:
//! let app: axum::Router = axum::Router::new().merge(idemkit_contract::router(&contract));
//! # let _ = app;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! What is specific to one service (a section about its gRPC methods, the example
//! bodies of its routes) is handed to [`Contract`] as data
//! ([`Contract::with_section`], [`Contract::with_example`]); the crate knows no
//! service.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use idemkit_client::{Jitter, RetryConfig, TokenBucket};
use idemkit_core::{ErrorCode, InFlightBehavior, MAX_KEY_LEN, Policy, ServerErrorPolicy};
use idemkit_engine::Disposition;
pub use idemkit_tower::config::{IdemkitConfig, RouteConfig};
use idemkit_tower::config::{KeyConvention, Mode};
use serde_json::{Value, json};

mod proxy;
mod router;

pub use proxy::{PROXY_DEFAULT_METHODS, ProxyContract, render_proxy};
pub use router::router;

/// The REST deadline header as the contract spells it (the wire name is
/// [`idemkit_core::wire::REQUEST_TIMEOUT`], case-insensitive).
pub const DEADLINE_HEADER_DISPLAY: &str = "Request-Timeout";

/// The example requests of one route: a valid body, and a different valid body
/// (the mismatch example). Without one, a route's examples send `{}`.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteExample {
    /// A valid request body (without the key: the contract adds it where the
    /// route reads it).
    pub body: Value,
    /// Another valid body, different from `body` (the mismatch example).
    pub different: Value,
}

/// A service's contract: its configuration, the client defaults it publishes,
/// and what is specific to the service (extra sections, example bodies).
#[derive(Debug, Clone)]
pub struct Contract {
    config: IdemkitConfig,
    client: RetryConfig,
    sections: Vec<String>,
    examples: BTreeMap<(String, String), RouteExample>,
}

impl Contract {
    /// The contract of `config`, publishing `idemkit-client`'s default retry
    /// configuration.
    pub fn new(config: IdemkitConfig) -> Self {
        Self {
            config,
            client: RetryConfig::new(),
            sections: Vec::new(),
            examples: BTreeMap::new(),
        }
    }

    /// Publishes `client` as the retry schedule integrators should follow.
    pub fn with_client(mut self, client: RetryConfig) -> Self {
        self.client = client;
        self
    }

    /// Adds a Markdown section (starting with its own `## ` heading) after the
    /// examples: what is specific to the service, such as its gRPC methods.
    pub fn with_section(mut self, markdown: impl Into<String>) -> Self {
        self.sections.push(markdown.into());
        self
    }

    /// The example bodies of the route `method path`.
    pub fn with_example(mut self, method: &str, path: &str, example: RouteExample) -> Self {
        self.examples
            .insert((method.to_ascii_uppercase(), path.to_owned()), example);
        self
    }

    /// The configuration the contract describes.
    pub fn config(&self) -> &IdemkitConfig {
        &self.config
    }

    /// The example of `route`: the one given, or `{}`.
    pub fn example(&self, route: &RouteConfig) -> RouteExample {
        self.examples
            .get(&(route.method.to_ascii_uppercase(), route.path.clone()))
            .cloned()
            .unwrap_or_else(|| RouteExample {
                body: json!({}),
                different: json!({"note": "a different request"}),
            })
    }

    /// The contract as `format` asks.
    pub fn render(&self, format: Format) -> String {
        in_format(markdown(self), format, &self.client)
    }

    /// The policy of every route as data (`/docs/idempotency.json`): the
    /// `x-idempotency` vocabulary, one object per operation.
    pub fn policy_document(&self) -> Value {
        self.config.policy_document()
    }

    /// Each route with its key where it really travels, its `x-idempotency` and
    /// the conflict responses, for merging into an OpenAPI document.
    pub fn openapi_fragment(&self) -> Value {
        openapi_fragment(&self.config)
    }
}

/// The `x-idempotency` OpenAPI extension of one route (see the guide's
/// `x-idempotency` page for the vocabulary).
pub fn x_idempotency(route: &RouteConfig) -> Value {
    route.x_idempotency()
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Markdown.
    #[default]
    Markdown,
    /// A standalone HTML page.
    Html,
}

/// The statuses of an answer the engine does not store but releases, so the
/// key is free again for the same or a corrected request (`Disposition::of`
/// for a 4xx under the default policy): the one list every page quotes.
pub fn released_statuses() -> Vec<u16> {
    (400..500)
        .filter(|s| Disposition::of(*s, None, &Policy::new()) == Disposition::Release)
        .collect()
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// Durations as integrators read them: whole hours or minutes when they are
/// (`24 h`, `5 min`, else `1s 500ms`).
pub fn human_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() == 0 && secs > 0 && secs.is_multiple_of(3600) {
        format!("{} h", secs / 3600)
    } else if d.subsec_nanos() == 0 && secs > 0 && secs.is_multiple_of(60) {
        format!("{} min", secs / 60)
    } else {
        humantime::format_duration(d).to_string()
    }
}

/// Renders the contract of `config` with `client` as the published retry
/// schedule (a [`Contract`] with nothing service-specific).
pub fn render(config: &IdemkitConfig, client: &RetryConfig, format: Format) -> String {
    Contract::new(config.clone()).with_client(*client).render(format)
}

/// The Markdown as `format` asks. The HTML page is standalone: an embedded
/// stylesheet (nothing is fetched from anywhere) and the worked retry schedule of
/// `client` drawn as an inline SVG timeline under its table.
fn in_format(markdown: String, format: Format, client: &RetryConfig) -> String {
    match format {
        Format::Markdown => markdown,
        Format::Html => {
            let mut body = String::new();
            pulldown_cmark::html::push_html(
                &mut body,
                pulldown_cmark::Parser::new_ext(&markdown, pulldown_cmark::Options::ENABLE_TABLES),
            );
            // The timeline goes right under the worked schedule's table.
            if let Some(at) = body.find(SCHEDULE_END) {
                body.insert_str(at, &timeline_svg(client));
            }
            format!(
                "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
                 <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
                 <title>Idempotency contract</title>\n<style>{STYLE}</style></head>\n\
                 <body><main>\n{body}</main></body></html>\n"
            )
        }
    }
}

/// Where the worked schedule's text resumes after its table (the timeline is
/// drawn before it).
const SCHEDULE_END: &str = "<p>Then the call returns its last error.";

/// The page's stylesheet: readable line lengths, tables with borders that
/// scroll inside themselves rather than widen the page, code set apart.
const STYLE: &str = "\
:root{color-scheme:light dark;--fg:#1b1f24;--bg:#fff;--muted:#57606a;--line:#d0d7de;--code:#f3f4f6;--accent:#0b63c5}\
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--bg:#0d1117;--muted:#9da7b3;--line:#30363d;--code:#161b22;--accent:#58a6ff}}\
*{box-sizing:border-box}\
body{margin:0;background:var(--bg);color:var(--fg);font:16px/1.6 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif}\
main{max-width:52rem;margin:0 auto;padding:2rem 1.25rem 4rem}\
h1{font-size:2rem;margin:0 0 1rem}h2{font-size:1.4rem;margin:2.5rem 0 .75rem;padding-bottom:.3rem;border-bottom:1px solid var(--line)}\
h3{font-size:1.1rem;margin:1.75rem 0 .5rem}\
a{color:var(--accent)}\
code{font:.875em/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:var(--code);padding:.1em .3em;border-radius:4px;overflow-wrap:anywhere}\
pre{background:var(--code);padding:.9rem 1rem;border-radius:6px;overflow-x:auto;border:1px solid var(--line)}\
pre code{background:none;padding:0;overflow-wrap:normal}\
table{display:block;max-width:100%;overflow-x:auto;border-collapse:collapse;margin:1rem 0;font-size:.925rem}\
th,td{border:1px solid var(--line);padding:.4rem .6rem;text-align:left;vertical-align:top}\
th{background:var(--code)}\
figure{margin:1rem 0}figcaption{color:var(--muted);font-size:.875rem}\
svg.timeline{width:100%;height:auto;max-width:48rem}\
svg.timeline text{font:12px system-ui,sans-serif;fill:var(--fg)}\
svg.timeline .axis{stroke:var(--muted)}svg.timeline .range{fill:var(--accent);opacity:.35}\
svg.timeline .at{fill:var(--accent)}svg.timeline .deadline{stroke:#cf222e;stroke-dasharray:4 3}\
";

/// The worked retry schedule as an inline SVG timeline: each attempt on a row,
/// the span of times it may start at (from all sleeps drawn as zero to all drawn
/// at their ceiling, attempts themselves taking no time), and the deadline.
fn timeline_svg(client: &RetryConfig) -> String {
    let attempts = client.max_attempts().max(1);
    // Latest possible start of each attempt, in milliseconds after the first.
    let mut latest = vec![0u128];
    for n in 1..attempts {
        let ceiling = client.backoff().ceiling(n - 1, Duration::ZERO);
        latest.push(latest[latest.len() - 1] + ceiling.as_millis());
    }
    let deadline = client.deadline().map(|d| d.as_millis());
    let span = deadline.unwrap_or(0).max(*latest.last().unwrap_or(&0)).max(1);
    let (left, width, row) = (96.0_f64, 520.0_f64, 30.0_f64);
    let x = |ms: u128| left + width * (ms as f64) / (span as f64);
    let height = row * f64::from(attempts) + 44.0;
    let mut svg = format!(
        "<figure><svg class=\"timeline\" viewBox=\"0 0 {w} {height}\" role=\"img\" \
         aria-labelledby=\"timeline-title\" xmlns=\"http://www.w3.org/2000/svg\">\
         <title id=\"timeline-title\">When each attempt of a call that keeps failing may start</title>",
        w = left + width + 24.0
    );
    for (i, &end) in latest.iter().enumerate() {
        let y = 14.0 + row * i as f64;
        let _ = write!(
            svg,
            "<text x=\"0\" y=\"{ty}\">attempt {n}</text>",
            ty = y + 12.0,
            n = i + 1
        );
        if end == 0 {
            let _ = write!(
                svg,
                "<circle class=\"at\" cx=\"{cx}\" cy=\"{cy}\" r=\"5\"/>",
                cx = x(0),
                cy = y + 8.0
            );
        } else {
            let _ = write!(
                svg,
                "<rect class=\"range\" x=\"{x0}\" y=\"{y}\" width=\"{rw}\" height=\"16\" rx=\"3\"/>\
                 <text x=\"{tx}\" y=\"{ty}\">≤ {label}</text>",
                x0 = x(0),
                rw = (x(end) - x(0)).max(2.0),
                tx = (x(end) + 4.0).min(left + width - 60.0),
                ty = y + 12.0,
                label = human_duration(Duration::from_millis(u64::try_from(end).unwrap_or(u64::MAX)))
            );
        }
    }
    let axis_y = 14.0 + row * f64::from(attempts) + 4.0;
    let _ = write!(
        svg,
        "<line class=\"axis\" x1=\"{left}\" y1=\"{axis_y}\" x2=\"{right}\" y2=\"{axis_y}\"/>\
         <text x=\"{left}\" y=\"{ly}\">0</text>",
        right = left + width,
        ly = axis_y + 16.0
    );
    if let Some(d) = deadline {
        let _ = write!(
            svg,
            "<line class=\"deadline\" x1=\"{dx}\" y1=\"6\" x2=\"{dx}\" y2=\"{axis_y}\"/>\
             <text x=\"{tx}\" y=\"{ly}\">deadline {label}</text>",
            dx = x(d),
            tx = x(d) - 70.0,
            ly = axis_y + 16.0,
            label = human_duration(Duration::from_millis(u64::try_from(d).unwrap_or(u64::MAX)))
        );
    }
    svg.push_str(
        "</svg><figcaption>Each bar spans the times an attempt may start after the first, from every \
         earlier sleep drawn as zero to every one drawn at its ceiling (the time the attempts themselves \
         take comes on top). Nothing starts after the deadline.</figcaption></figure>\n",
    );
    svg
}

/// One keyed route as the `## Routes` table shows it.
struct KeyedRoute {
    /// `` `POST /labels` ``, or `` `POST` (any path) ``.
    route: String,
    /// Where the key travels.
    key: String,
    /// The route's effective policy.
    policy: Policy,
    /// The response headers a replay carries (when the first answer had them).
    replayed: String,
}

impl KeyedRoute {
    fn of(r: &RouteConfig) -> Self {
        Self {
            route: format!("`{} {}`", r.method, r.path),
            key: match (&r.key_field, r.key) {
                (_, KeyConvention::Repeatability) => "headers `Repeatability-Request-ID` and `Repeatability-First-Sent` (OASIS Repeatable Requests 1.0)".to_owned(),
                (Some(f), _) => format!("JSON body field `{f}`"),
                (None, _) => format!("header `{}`", r.key_header()),
            },
            replayed: r
                .replayed_headers()
                .iter()
                .map(|h| format!("`{h}`"))
                .collect::<Vec<_>>()
                .join(", "),
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
        "| route | key | replay status | replayed headers | longest retry chain | on 5xx | while in flight |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|---|");
    for r in routes {
        let p = &r.policy;
        let replay = p.replay_status.map_or("the stored status".to_owned(), |s| {
            format!("{s} for a stored 2xx")
        });
        let chain = p.longest_retry_chain.map_or("—".to_owned(), human_duration);
        let five = match p.on_server_error {
            ServerErrorPolicy::Replay => "stored and replayed",
            _ => "not stored: retry with the same key",
        };
        let in_flight = match p.in_flight {
            InFlightBehavior::Wait(t) => format!("waits up to {}, then replays or 409", human_duration(t)),
            InFlightBehavior::Accepted if !proxy => "202 with a status URL".to_owned(),
            _ => "409 `idempotency_request_in_progress` with `Retry-After`".to_owned(),
        };
        let _ = writeln!(
            w,
            "| {} | {} | {replay} | {} | {chain} | {five} | {in_flight} |",
            r.route, r.key, r.replayed
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

/// The keyed routes of each mode, as the contract names them (`` `POST /x` ``).
#[derive(Debug, Default)]
struct Modes {
    /// Lease-mode routes.
    lease: Vec<String>,
    /// Single-step routes.
    single_step: Vec<String>,
}

impl Modes {
    fn of(config: &IdemkitConfig) -> Self {
        let mut modes = Self::default();
        for r in config.routes.iter().filter(|r| r.retry_safe) {
            let name = format!("`{} {}`", r.method, r.path);
            match r.mode() {
                Mode::SingleStep => modes.single_step.push(name),
                _ => modes.lease.push(name),
            }
        }
        modes
    }

    /// Every route in lease mode (the proxy's).
    fn all_lease() -> Self {
        Self::default()
    }

    /// `(heading, bullets)` for each mode present: no heading when there is one
    /// (lease mode when there is none: it promises the least).
    fn each<'a>(&'a self, lease: &'a str, single_step: &'a str) -> Vec<(Option<String>, &'a str)> {
        if self.single_step.is_empty() {
            return vec![(None, lease)];
        }
        if self.lease.is_empty() {
            return vec![(None, single_step)];
        }
        vec![
            (Some(format!("On {} (lease mode):", self.lease.join(", "))), lease),
            (
                Some(format!("On {} (single-step mode):", self.single_step.join(", "))),
                single_step,
            ),
        ]
    }
}

/// Writes `bullets` for each mode of `modes`, under a heading per mode when
/// the routes have both.
fn per_mode(w: &mut String, modes: &Modes, lease: &str, single_step: &str) {
    for (heading, bullets) in modes.each(lease, single_step) {
        if let Some(h) = heading {
            let _ = writeln!(w, "\n{h}\n");
        }
        let _ = writeln!(w, "{bullets}");
    }
}

/// The `## Windows` section; `takeover` says what a retry does with a
/// lease-mode request whose server died.
fn windows(w: &mut String, policy: &Policy, modes: &Modes, takeover: &str) {
    let _ = writeln!(w, "\n## Windows\n");
    let _ = writeln!(
        w,
        "- A completed request replays for **{}** (the replay window). After that, the same key starts a new request.\n\
         - Records are kept **{}** for investigation, without replaying after the window.",
        human_duration(policy.replay_window),
        human_duration(policy.reap_threshold),
    );
    let lease = format!(
        "- A request in flight holds its key for a lease of **{}**, extended while it runs; {takeover}.\n\
         - The window applies to completed requests only: a request that never finished is resumed (or held for \
         review) however old it is; it never starts over as a new request.\n\
         - **If you hang up mid-request, the request still runs to its end.** Closing the connection (a client \
         timeout) does not cancel it: retry with the same key and you get its one result (`409 \
         idempotency_request_in_progress` while it runs, then the stored answer), never a second execution.",
        human_duration(policy.lease)
    );
    let single_step = "- A request in flight holds its key in one database transaction with everything it writes \
         and its answer: they commit together when it answers, or not at all. If its server dies mid-request, all of \
         it rolls back and a retry with the same key runs as a first attempt.\n\
         - **If you hang up mid-request, the request is cut short and rolled back.** When the service sees the \
         connection close (a client timeout), it drops the request: its transaction rolls back, nothing it wrote is \
         kept and the key is free. A retry with the same key gets the stored answer if the request had already \
         committed, or else runs as a first attempt: one result, never two.";
    per_mode(w, modes, &lease, single_step);
}

/// The `## Answers` section; `validation` is its bullet on validation errors.
fn answers(w: &mut String, validation: &str, mismatch_status: u16) {
    let _ = writeln!(w, "\n## Answers\n");
    let _ = writeln!(
        w,
        "- A replay is byte-identical to the first answer and carries `Idempotent-Replayed: true`, with the \
         route's replayed headers (table above) as first sent; never `Set-Cookie`, hop-by-hop headers or `Date`.\n\
         - A compressed answer is stored with its `Content-Encoding` and replayed only to a request whose \
         `Accept-Encoding` names that coding (or `*`); any other gets `406 idempotency_replay_not_acceptable` \
         (the request is not run again: repeat it accepting the coding).\n\
         - A streaming answer (`text/event-stream`) on a keyed route is never stored nor replayed in part: the \
         request is answered `500 idempotency_streaming_unsupported`.\n\
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
    let deadline = client.deadline().map_or("none".to_owned(), human_duration);
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
        human_duration(client.retry_after_cap()),
        client.max_attempts(),
        human_duration(base),
        human_duration(cap),
        human_duration(client.throttling_backoff().base()),
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
        let _ = writeln!(w, "| {} | 0 – {} |", n + 1, human_duration(ceiling));
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

fn markdown(contract: &Contract) -> String {
    let (config, client) = (&contract.config, &contract.client);
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
    let modes = Modes::of(config);
    windows(
        w,
        &defaults_policy(config),
        &modes,
        "if its server dies, a retry after the lease takes it over and resumes it",
    );
    answers(
        w,
        &format!(
            "- Answers {} (validation, authentication, size, media type, or transient: timeout, too early, \
             throttled) are not stored: the key is free again, so fix the request (or wait) and send it again \
             with the same key.",
            and_list(
                &released_statuses()
                    .iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
            )
        ),
        d.mismatch_status,
    );
    retrying(w, client);

    deadlines(w, &modes, config.service.grpc);

    let _ = writeln!(w, "\n## Examples\n");
    let _ = writeln!(
        w,
        "Each keyed route, with commands to paste (set `BASE` to the service's URL and `TOKEN` to your bearer \
         token). Running them in order shows the four answers a retrying client meets."
    );
    for r in config.routes.iter().filter(|r| r.retry_safe) {
        examples(w, r, &contract.example(r));
    }

    for section in &contract.sections {
        let _ = writeln!(w, "\n{}", section.trim_end());
    }

    let _ = writeln!(w, "\n## Policy as data\n");
    let mut served = Vec::new();
    if let Some(path) = &config.service.openapi {
        served.push(format!(
            "every keyed operation of `GET {path}` carries it as an `x-idempotency` object"
        ));
    }
    if config.service.contract_routes {
        served.push(
            "`GET /docs/idempotency.json` serves it for every route (and `GET /docs/idempotency` this page)"
                .to_owned(),
        );
    }
    let served = if served.is_empty() {
        "the OpenAPI fragment below carries it as an `x-idempotency` object on each operation".to_owned()
    } else {
        served.join(", and ")
    };
    let _ = writeln!(
        w,
        "The policy above is also published for programs: {served}, generated from the same configuration (the \
         vocabulary is specified in idemkit's `docs/x-idempotency.md`). `idemkit lint-openapi` reads it, \
         `idemkit check --policy` compares it with what the service does, and `idemkit_client::PublishedPolicy` \
         tells a client where each operation's key goes."
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

/// The `## Deadlines` section: what `Request-Timeout` does on each mode's
/// routes, and over gRPC when the service serves it.
fn deadlines(w: &mut String, modes: &Modes, grpc: bool) {
    let _ = writeln!(w, "\n## Deadlines\n");
    let _ = writeln!(
        w,
        "Tell the service how long you are still willing to wait with \
         `{DEADLINE_HEADER_DISPLAY}: <milliseconds>`: the time left of your deadline, in whole milliseconds \
         (1 to {} digits, no unit; round down). It is relative on purpose, so clock skew between you and the \
         service does not matter; the service counts it from the moment your request arrives. Send it again on \
         every retry with what is left then. The Rust client `idemkit-client` sends it on every attempt: that \
         attempt's timeout, never more than what is left of the call's deadline.\n\n\
         - **Already spent** (`{DEADLINE_HEADER_DISPLAY}: 0`, or gone by the time the request arrives): a \
         request that already completed with this key gets its stored answer (a replay costs nothing, so no \
         deadline is too short for it); any other gets `504` with `code` `deadline_exceeded` and \
         `retryable: false`. Nothing ran and the key was **not** claimed: a later call with a fresh budget may \
         use the same key.\n\
         - A malformed value (a sign, a fraction, a unit, more than {} digits) is ignored: the request has no \
         deadline.",
        idemkit_core::DEADLINE_HEADER_MAX_DIGITS,
        idemkit_core::DEADLINE_HEADER_MAX_DIGITS,
    );
    let lease = "- **Otherwise** the request runs, and the remaining time is handed to the handler, which can pass it \
         on to its own downstream calls. A request is not cut short when your deadline passes: like a request whose \
         client hung up, it runs to its end and a retry with the same key gets its one result.";
    let single_step = "- **Otherwise** the request runs, and the remaining time is handed to the handler. A request \
         still running when your deadline passes is **cut short**: it is answered `504` with `code` \
         `deadline_exceeded` and `retryable: false`, its transaction is rolled back (nothing it wrote is kept, \
         nothing is stored) and the key is free. A later call with a fresh budget may send the same request with \
         the same key: it runs as a first attempt. A request whose deadline is shorter than its work never \
         completes, so give it the time it needs.";
    per_mode(w, modes, lease, single_step);
    if grpc {
        let _ = writeln!(
            w,
            "- Over gRPC the deadline is the standard `grpc-timeout` your gRPC library sends from the call's \
             deadline; one already spent is answered with the stored answer of a completed request, or else with \
             `DEADLINE_EXCEEDED` and a `google.rpc.ErrorInfo` whose `reason` is `deadline_exceeded`, again before \
             the key is claimed. A gRPC call is never cut short at its deadline (gRPC runs in lease mode): it runs \
             to its end and a retry with the same key gets its one result."
        );
    }
}

/// The body with `key` set where the route reads it (a body route, the key
/// first), and the headers that carry it (a header route): how the examples
/// send a key, for service-specific sections that show their own.
pub fn keyed_body(route: &RouteConfig, body: &Value, key: &str) -> (Value, Vec<String>) {
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
        None if route.key == KeyConvention::Repeatability => (
            body,
            vec![
                format!("Repeatability-Request-ID: {key}"),
                "Repeatability-First-Sent: $FIRST_SENT".to_owned(),
            ],
        ),
        None => (body, vec![format!("{}: {key}", route.key_header())]),
    }
}

/// One `curl` command.
fn curl(route: &RouteConfig, headers: &[String], body: &Value) -> String {
    let mut cmd = format!(
        "curl -i -X {} \"$BASE{}\" \\\n  -H \"Authorization: Bearer $TOKEN\" -H 'Content-Type: application/json'",
        route.method, route.path
    );
    for h in headers {
        if h.contains('$') {
            // A shell variable (`$FIRST_SENT`) is expanded.
            cmd.push_str(&format!(" -H \"{h}\""));
        } else {
            cmd.push_str(&format!(" -H '{h}'"));
        }
    }
    cmd.push_str(&format!(" \\\n  -d '{body}'"));
    cmd
}

/// The four answers of one route: first request, replay, mismatch, in progress.
fn examples(w: &mut String, r: &RouteConfig, example: &RouteExample) {
    let p = r.policy();
    let where_key = match (&r.key_field, r.key) {
        (_, KeyConvention::Repeatability) => "in the `Repeatability-Request-ID` header (OASIS Repeatable Requests 1.0), \
             with `Repeatability-First-Sent`: the HTTP-date of the first attempt, set once \
             (`FIRST_SENT=$(LC_ALL=C date -u '+%a, %d %b %Y %H:%M:%S GMT')`) and sent unchanged on every retry; one older than \
             the replay window (or more than a minute ahead) is `412 repeatability_first_sent_out_of_window`. Answers \
             carry `Repeatability-Result: accepted` (ran, or replayed) or `rejected`"
            .to_owned(),
        (Some(f), _) => format!("in the JSON body field `{f}`"),
        (None, _) => format!("in the `{}` header", r.key_header()),
    };
    let body = &example.body;
    let (first, headers) = keyed_body(r, body, "order-4711-label");
    let (other, _) = keyed_body(r, &example.different, "order-4711-label");
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
    let (fresh, fresh_headers) = keyed_body(r, body, "order-4712-label");
    let _ = writeln!(
        w,
        "4. In progress: two identical requests with a fresh key at once. One runs; while it does, the other {}.\n",
        match p.in_flight {
            InFlightBehavior::Wait(t) => format!(
                "waits up to {} for its answer, then replays it (or gets `409`)",
                human_duration(t)
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

/// Each route of `config` with its key where it really travels (a header
/// parameter, or a required member of the JSON body), its `x-idempotency`, and
/// the conflict responses, for merging into a service's OpenAPI document.
pub fn openapi_fragment(config: &IdemkitConfig) -> Value {
    let mut paths = serde_json::Map::new();
    let mut needs_422 = false;
    for r in &config.routes {
        let x = r.x_idempotency();
        let mut op = json!({ "x-idempotency": x });
        if r.retry_safe {
            let p = r.policy();
            let key_schema = json!({"type": "string", "minLength": 1, "maxLength": MAX_KEY_LEN,
                "description": format!("The idempotency key: 1–{MAX_KEY_LEN} visible ASCII characters, scoped to the caller's account; replays for {}.", human_duration(p.replay_window))});
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
