//! The contract of an API served through `idemkit proxy` (`idemkit docs --proxy`).

use super::*;

/// The methods `idemkit proxy` keys on every path when it runs without a
/// configuration (the methods the layer guards by default), each with the
/// default policy and the `Idempotency-Key` header.
pub const PROXY_DEFAULT_METHODS: [&str; 4] = ["POST", "PUT", "PATCH", "DELETE"];

/// What an API served through `idemkit proxy` runs with: the input of its
/// integrator contract ([`render_proxy`]).
#[derive(Debug, Clone)]
pub struct ProxyContract {
    /// The proxy's `--config`: its `retry_safe` routes are the keyed ones. `None`:
    /// the proxy's default, every method of [`PROXY_DEFAULT_METHODS`] on every
    /// path, keyed by the `Idempotency-Key` header with the default policy.
    pub config: Option<IdemkitConfig>,
    /// The proxy's `--upstream-honours-keys`: a request whose outcome is unknown
    /// is re-sent to the upstream with the same key instead of being parked.
    pub upstream_honours_keys: bool,
    /// The header carrying the caller's credential (`--account-header`).
    pub account_header: String,
    /// The largest keyed request body the proxy accepts, in bytes
    /// (`--max-request-body`).
    pub max_request_body: usize,
    /// The proxy's `--lease-ms` without `--config`: the default table's lease
    /// (`None`: the default policy's). With a configuration, the proxy applies
    /// it to the configuration (`IdemkitConfig::with_lease`); so does the
    /// caller, before handing it over here.
    pub default_lease: Option<std::time::Duration>,
    /// Per keyed route (`"METHOD /path"`, the method upper-cased), the `5xx`
    /// statuses the operator declared "not executed" (`not_executed` in the
    /// proxy's `--config`): the key is freed on them. Every other `5xx` of an
    /// upstream that ignores keys is stored and replayed (`502`/`504`: parked).
    pub not_executed: std::collections::BTreeMap<String, Vec<u16>>,
    /// Per keyed route (`"METHOD /path"`), the response headers replayed on top
    /// of the default allowlist (`replayed_headers` in the proxy's `--config`).
    pub replayed_headers: std::collections::BTreeMap<String, Vec<String>>,
}

/// The codes the proxy answers with, in the order its contract lists them.
const PROXY_CODES: [ErrorCode; 13] = [
    ErrorCode::KeyMissing,
    ErrorCode::KeyInvalid,
    ErrorCode::Unauthorized,
    ErrorCode::PayloadTooLarge,
    ErrorCode::ValidationFailed,
    ErrorCode::KeyReused,
    ErrorCode::RequestInProgress,
    ErrorCode::RequestParked,
    ErrorCode::LeaseLost,
    ErrorCode::StoreUnavailable,
    ErrorCode::ResponseTooLarge,
    ErrorCode::ReplayNotAcceptable,
    ErrorCode::Internal,
];

/// Renders the contract of an API served through `idemkit proxy`: the generic
/// parts of [`render`] (routes, key, windows, answers, retrying) from the
/// proxy's configuration, its problem codes, and what the proxy cannot promise
/// (`## Behind idemkit proxy`); none of the labels service's own sections.
pub fn render_proxy(proxy: &ProxyContract, client: &RetryConfig, format: Format) -> String {
    in_format(proxy_markdown(proxy, client), format, client)
}

/// Sizes as integrators read them: whole MiB or KiB when they are.
fn size(n: usize) -> String {
    if n > 0 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n > 0 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

fn proxy_markdown(proxy: &ProxyContract, client: &RetryConfig) -> String {
    let (keyed, windows_policy, mismatch_status) = match &proxy.config {
        Some(config) => (
            config
                .routes
                .iter()
                // The proxy keys no safe method, whatever the file says.
                .filter(|r| {
                    r.retry_safe
                        && !http::Method::from_bytes(r.method.to_ascii_uppercase().as_bytes())
                            .is_ok_and(|m| m.is_safe())
                })
                .map(KeyedRoute::of)
                .collect::<Vec<_>>(),
            defaults_policy(config),
            config.defaults.mismatch_status,
        ),
        None => {
            let policy = proxy
                .default_lease
                .map_or_else(Policy::new, |lease| Policy::new().with_lease(lease));
            let header = idemkit_tower::config::RouteDefaults::default().key_header;
            let keyed = PROXY_DEFAULT_METHODS
                .iter()
                .map(|m| KeyedRoute {
                    route: format!("`{m}` (any path)"),
                    key: format!("header `{header}`"),
                    replayed: idemkit_core::DEFAULT_REPLAYED_HEADERS
                        .iter()
                        .map(|h| format!("`{h}`"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    policy: policy.clone(),
                })
                .collect();
            let mismatch = policy.mismatch_status.as_u16();
            (keyed, policy, mismatch)
        }
    };
    let credential = &proxy.account_header;
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "# Idempotency contract\n");
    let _ = writeln!(
        w,
        "Retried writes to this API are **effectively once within the key scope and replay window**: \
         at-least-once delivery plus de-duplication by idempotency key, done by `idemkit proxy` in front of the \
         service, within the limit stated under *Behind idemkit proxy*. This page is generated from the \
         configuration the proxy runs with (`idemkit docs --proxy`).\n"
    );

    proxy_routes_table(w, proxy, &keyed);
    match &proxy.config {
        Some(config) => unkeyed_and_descriptions(w, config),
        None => {
            let _ = writeln!(
                w,
                "\nEvery {} request is keyed, whatever its path.",
                and_list(&PROXY_DEFAULT_METHODS.map(str::to_owned))
            );
        }
    }
    the_key(
        w,
        &format!(
            "- Scope: **(your credential, key)**: the proxy scopes keys by a keyed hash of your `{credential}` \
             header's value. Another credential's identical key is a different request, so send the same \
             credential on every retry of one request (a retry with a refreshed token runs again)."
        ),
    );
    windows(
        w,
        &windows_policy,
        &Modes::all_lease(),
        "if the proxy dies, a retry after the lease takes it over (see *When the outcome is unknown* below)",
    );
    let released: Vec<String> = released_statuses().iter().map(u16::to_string).collect();
    answers(
        w,
        &format!(
            "- The service's validation-class answers ({}) are passed to you and not stored: the key is free \
             again, so the same key may carry the same request or a corrected one, forwarded as a first attempt.",
            and_list(&released)
        ),
        mismatch_status,
    );
    behind_the_proxy(w, proxy, &keyed, &released);
    proxy_codes(w, proxy, mismatch_status);
    retrying(w, client);
    out
}

/// The statuses declared "not executed" on `route` (`` `POST /x` ``, as
/// [`KeyedRoute::route`] spells it).
fn declared<'a>(proxy: &'a ProxyContract, route: &str) -> &'a [u16] {
    proxy
        .not_executed
        .get(route.trim_matches('`'))
        .map_or(&[], Vec::as_slice)
}

fn statuses(list: &[u16]) -> String {
    and_list(&list.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>())
}

/// The `## Routes` table as the proxy runs it: its *on 5xx* column says what
/// the proxy does with an upstream's answered `5xx` on each route.
fn proxy_routes_table(w: &mut String, proxy: &ProxyContract, routes: &[KeyedRoute]) {
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
        let chain = p.longest_retry_chain.map_or("—".to_owned(), human_duration);
        let mut five = match (p.on_server_error, proxy.upstream_honours_keys) {
            (ServerErrorPolicy::Replay, _) => "stored and replayed".to_owned(),
            (_, true) => {
                "not stored: retry with the same key (`502`, `504`: re-sent with the same key)".to_owned()
            }
            (_, false) => "**stored and replayed** (`502`, `504`: parked, outcome unknown)".to_owned(),
        };
        let declared = declared(proxy, &r.route);
        if !declared.is_empty() {
            five.push_str(&format!(
                "; {}: declared not executed, not stored, the key is free",
                statuses(declared)
            ));
        }
        let in_flight = match p.in_flight {
            InFlightBehavior::Wait(t) => format!("waits up to {}, then replays or 409", human_duration(t)),
            _ => "409 `idempotency_request_in_progress` with `Retry-After`".to_owned(),
        };
        let _ = writeln!(
            w,
            "| {} | {} | {replay} | {chain} | {five} | {in_flight} |",
            r.route, r.key
        );
    }
}

/// The `## Behind idemkit proxy` section: what the proxy does to a keyed
/// request, and what it cannot promise.
fn behind_the_proxy(w: &mut String, proxy: &ProxyContract, keyed: &[KeyedRoute], released: &[String]) {
    let credential = &proxy.account_header;
    let unauthorized = ErrorCode::Unauthorized;
    let parked = ErrorCode::RequestParked;
    let internal = ErrorCode::Internal;
    let too_large = ErrorCode::PayloadTooLarge;
    let _ = writeln!(w, "\n## Behind idemkit proxy\n");
    let _ = writeln!(
        w,
        "This API is served through `idemkit proxy`: the proxy keeps the idempotency records and forwards each \
         keyed request to the service behind it (the upstream), which does the work. **The proxy shares no \
         transaction with the upstream's database**: between forwarding a request and storing the answer there \
         is a moment when the upstream may have acted and the proxy does not know it. What happens then is \
         said under *When the outcome is unknown*.\n"
    );
    let routes = match &proxy.config {
        Some(_) if keyed.is_empty() => "none: every request is forwarded untouched".to_owned(),
        Some(_) => format!(
            "{}, matched by method and path (a `{{name}}` segment matches any one segment) on one spelling of \
             the path: another spelling the upstream might route to the same handler (other letter case, a \
             trailing or doubled slash, a `.` or `..` segment, `;` parameters, a percent-encoded character that \
             needs none) is refused with `400` `validation_failed` and never forwarded",
            and_list(&keyed.iter().map(|r| r.route.clone()).collect::<Vec<_>>())
        ),
        None => format!(
            "every {} request, on any path",
            and_list(&PROXY_DEFAULT_METHODS.map(str::to_owned))
        ),
    };
    let declared_routes: Vec<String> = keyed
        .iter()
        .filter(|r| !declared(proxy, &r.route).is_empty())
        .map(|r| format!("{} on {}", statuses(declared(proxy, &r.route)), r.route))
        .collect();
    let declared_text = if declared_routes.is_empty() {
        String::new()
    } else {
        format!(
            " The operator declared these answers \"not executed\" (the upstream gives them only when it did \
             nothing): {}. They are passed to you, not stored, and free the key: retry with the same key.",
            and_list(&declared_routes)
        )
    };
    let five = if proxy.upstream_honours_keys {
        let retry = keyed
            .iter()
            .filter(|r| r.policy.on_server_error == ServerErrorPolicy::Retry)
            .count();
        let stored = if retry == keyed.len() {
            "passed to you and not stored: retry with the same key (the upstream de-duplicates it)"
        } else if retry == 0 {
            "stored and replayed like any other answer"
        } else {
            "stored or not by the route's policy (*on 5xx* under *Routes*)"
        };
        let gateway = if retry > 0 {
            ", except a `502` or `504` that is not stored: that is an unknown outcome (*When the outcome is \
             unknown*)"
        } else {
            ""
        };
        format!(
            "`5xx` answers are {stored}{gateway}. The upstream's own `409` \"in progress\" answer (it still runs an \
             earlier send of your key: a `409` with `Retry-After` or with `code` `idempotency_request_in_progress`) \
             is passed to you with its `Retry-After` and never stored.{declared_text}"
        )
    } else {
        format!(
            "This upstream does not de-duplicate by key, and a `5xx` may come after it did the work (a `500` \
             after its commit, a sidecar's `503` on a reset), so an answered `5xx` is **stored and replayed** like \
             any other answer: a retry with the same key gets the same `5xx` again and never runs the request a \
             second time. Do not retry a stored `5xx` with a new key without checking the outcome first. A `502` \
             or `504` (a gateway's answer) is an unknown outcome instead (*When the outcome is unknown*), unless \
             the route stores `5xx` (*on 5xx* under *Routes*).{declared_text}"
        )
    };
    let extra_headers: Vec<String> = proxy
        .replayed_headers
        .iter()
        .filter(|(route, _)| keyed.iter().any(|k| k.route.trim_matches('`') == route.as_str()))
        .map(|(route, hs)| {
            format!(
                "{} on `{route}`",
                and_list(&hs.iter().map(|h| format!("`{h}`")).collect::<Vec<_>>())
            )
        })
        .collect();
    let extra_headers = if extra_headers.is_empty() {
        String::new()
    } else {
        format!(", and {}", and_list(&extra_headers))
    };
    let key_header = match keyed.first() {
        Some(r) if r.key.starts_with("header ") && keyed.iter().all(|k| k.key == r.key) => {
            r.key.trim_start_matches("header ").to_owned()
        }
        _ => "the key header".to_owned(),
    };
    let _ = writeln!(
        w,
        "- **Keyed routes:** {routes}. Every other request (and every `GET`, `HEAD`, `OPTIONS` and `TRACE`) is forwarded \
         untouched: no key is read and nothing is de-duplicated.\n\
         - **Exactly one non-empty `{credential}` header is required** on a keyed route: without it (or with \
         an empty one, or two) the proxy answers `{}` `{unauthorized}` and the request is never forwarded. The scope is a keyed hash (HMAC-SHA256) of the \
         header's value; the credential itself is never stored.\n\
         - **Your key is forwarded to the upstream as sent**, where you put it (header or body).\n\
         - **A `Connection` header that names `{credential}` or {key_header}** is refused with `400` \
         `validation_failed`: those headers must reach the upstream, and `Connection` would strip them.\n\
         - **Answers.** Validation-class answers ({}) are not stored and free the key: the same key, with the request \
         corrected or not, is forwarded again. So are `404` and `405` (a route or method the upstream does not \
         have). {five} Every other answer is stored and replayed byte for byte, with `Idempotent-Replayed: true`; a \
         replay carries the stored status, body and the headers {}{extra_headers}. `Set-Cookie` and hop-by-hop \
         headers are never stored.\n\
         - **Compression is per caller.** The proxy asks the upstream for `Accept-Encoding: identity` on keyed \
         routes and stores the uncompressed bytes; each answer, the first and every replay alike, is compressed for \
         you as your own `Accept-Encoding` asks (`gzip` or `deflate`, with `Vary: accept-encoding`), and sent \
         uncompressed when you send none or only `identity`. An upstream that compresses anyway has its \
         `Content-Encoding` stored with its bytes: you get them if your `Accept-Encoding` accepts that coding, \
         otherwise `406` `idempotency_replay_not_acceptable` naming it (the request is not run again; repeat it \
         accepting the coding).\n\
         - **Stored request bodies** are dropped once the answer is stored; the request's fingerprint is kept, so \
         a retry is still matched to it.\n\
         - **Streams.** An answer of server-sent events (`text/event-stream`) on a keyed route reaches you as \
         the upstream sends it; a retry with the same key gets the whole stream again at once, in order (a \
         stream over the storage cap is answered `idempotency_response_too_large` on retries instead).\n\
         - **If the proxy's key store fails after the upstream answered**, you still get the upstream's answer, \
         and the proxy keeps trying to store it (for up to 5 minutes, with backoff), so your retry with the same \
         key gets the replay (`503` `idempotency_store_unavailable` or `409` `idempotency_request_in_progress` \
         until then). If the proxy stops before it could, your retry finds the request forwarded and unanswered: \
         see *When the outcome is unknown*.\n\
         - **Request size.** A keyed request body over **{}** is `{}` `{too_large}`; nothing is claimed or \
         forwarded.\n\
         - **The proxy's own paths**, everything under `/_idemkit/` (`/_idemkit/live`, `/_idemkit/ready`, \
         `/_idemkit/metrics`), are answered by the proxy and never forwarded; `/healthz` is the upstream's.\n\
         - **Deploys.** A proxy told to stop lets the requests in flight finish and store before it exits.\n\
         - **Deadlines.** The proxy does not act on `{DEADLINE_HEADER_DISPLAY}`: it is forwarded to the \
         upstream like any other header.",
        unauthorized.default_status(),
        and_list(released),
        and_list(
            &idemkit_core::DEFAULT_REPLAYED_HEADERS
                .iter()
                .map(|h| format!("`{h}`"))
                .collect::<Vec<_>>()
        ),
        size(proxy.max_request_body),
        too_large.default_status(),
    );
    let _ = writeln!(w, "\n### When the outcome is unknown\n");
    let _ = writeln!(
        w,
        "The outcome of a keyed request is unknown when the upstream did not answer in time, when the \
         connection failed after the request was sent (or part-way through an answer to be stored), when the \
         upstream answered `502` or `504` on a route that does not store `5xx` (a gateway's answer: the \
         service behind it may have run the request), or when the proxy died after forwarding it (a retry \
         after the lease finds it). A connection that failed *before* sending is not one of them (a request that never left on a \
         reused connection is sent again on a fresh one): you get `502` `{internal}` (`retryable: {}`), nothing was sent, and a retry with the same key is forwarded again.\n",
        internal.retryable()
    );
    if proxy.upstream_honours_keys {
        let _ = writeln!(
            w,
            "This upstream de-duplicates by idempotency key itself, so **the same key is re-sent to the \
             upstream**. When the upstream timed out or failed after the request was sent, you get `502` or \
             `504` with `code` `{internal}`, `retryable: {}` and `Retry-After`: retry with the same key. After a \
             timeout the proxy keeps waiting for the upstream's answer a while longer, holding your key: a retry \
             meanwhile gets `409` `idempotency_request_in_progress` (retry after `Retry-After`), and an answer \
             that arrives is stored and replayed to it. After that, the retry (like a retry after the proxy died) \
             is forwarded again with the same key, and the upstream's own de-duplication makes it one effect.\n\n\
             What this costs: the upstream must de-duplicate by key itself, for your scope and for as long as \
             you retry. The guarantee is only as good as its key handling.",
            internal.retryable()
        );
    } else {
        let _ = writeln!(
            w,
            "This upstream does not de-duplicate by key, so the proxy never sends such a request twice: the \
             request is **parked for review**. You get `{}` with `code` `{parked}` (`retryable: {}`), and so \
             does every retry with that key; the retry never reaches the upstream again.\n\n\
             **Treat `{parked}` as \"outcome unknown\"**: the request may or may not have taken effect. Do not \
             create a new request with a new key without checking first (read the resource, or ask the API's \
             operator): that is how duplicates are made.\n\n\
             What this costs: a person settles each parked request. The operator finds it with `idemkit keys \
             list --state parked`, checks the upstream, and if the request did nothing there releases the key \
             (`idemkit keys release --downstream-did-nothing`), so your next retry with the same key is forwarded \
             again; if it did act, the key stays parked and the operator tells you the outcome.",
            parked.default_status(),
            parked.retryable()
        );
    }
}

/// The `## Problem codes` table of the proxy's contract.
fn proxy_codes(w: &mut String, proxy: &ProxyContract, mismatch_status: u16) {
    let credential = &proxy.account_header;
    let _ = writeln!(w, "\n## Problem codes\n");
    let _ = writeln!(
        w,
        "Every refusal of the proxy is a problem document with one of these codes:\n"
    );
    let _ = writeln!(w, "| `code` | status | `retryable` | meaning |");
    let _ = writeln!(w, "|---|---|---|---|");
    for code in PROXY_CODES {
        let status = match code {
            ErrorCode::KeyReused => mismatch_status.to_string(),
            ErrorCode::Internal => format!("{}, 502, 503, 504", code.default_status()),
            _ => code.default_status().to_string(),
        };
        let meaning = match code {
            ErrorCode::KeyMissing => "no key on a keyed route; nothing was forwarded".to_owned(),
            ErrorCode::KeyInvalid => "a malformed key, or more than one; nothing was forwarded".to_owned(),
            ErrorCode::Unauthorized => {
                format!("no `{credential}` header on a keyed route; nothing was forwarded")
            }
            ErrorCode::PayloadTooLarge => format!(
                "the request body is over {}; nothing was claimed or forwarded",
                size(proxy.max_request_body)
            ),
            ErrorCode::ValidationFailed => {
                "the request body could not be read or did not arrive in time, a `Connection` header names the \
                 credential or key header, or the path is another spelling of a keyed route's path; nothing was \
                 forwarded"
                    .to_owned()
            }
            ErrorCode::KeyReused => {
                "the key was used with a different request: do not retry; a new request needs a new key"
                    .to_owned()
            }
            ErrorCode::RequestInProgress => {
                "the first request with this key is still running: retry after `Retry-After`".to_owned()
            }
            ErrorCode::RequestParked if proxy.upstream_honours_keys => continue,
            ErrorCode::RequestParked => {
                "outcome unknown, parked for review: do not retry with a new key without checking \
                 (*When the outcome is unknown*)"
                    .to_owned()
            }
            ErrorCode::LeaseLost => {
                "another attempt took the request over: retry with the same key".to_owned()
            }
            ErrorCode::StoreUnavailable => {
                "the proxy's key store failed before anything was forwarded (or your retry came while the \
                 store is down): retry with the same key"
                    .to_owned()
            }
            ErrorCode::ResponseTooLarge => {
                "the upstream's answer was too large to store; the key answers this from now on".to_owned()
            }
            ErrorCode::ReplayNotAcceptable => {
                "the stored answer is in a `Content-Encoding` (the upstream compressed it anyway) your \
                 `Accept-Encoding` does not accept: repeat the request accepting that coding; it is not run again"
                    .to_owned()
            }
            _ => {
                let keyed = if proxy.upstream_honours_keys {
                    "`502`: the upstream could not be reached (nothing was sent) or failed after the request was \
                     sent; `504`: it did not answer in time"
                } else {
                    "`502`: the upstream could not be reached; nothing was sent; `504`: it did not answer an \
                     unkeyed request in time"
                };
                format!(
                    "{keyed}; `503`: the proxy holds as many request bodies as it may, nothing was claimed or \
                     forwarded (retry after `Retry-After`). Retry with the same key"
                )
            }
        };
        let _ = writeln!(w, "| `{code}` | {status} | {} | {meaning} |", code.retryable());
    }
}
