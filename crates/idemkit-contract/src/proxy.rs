//! The contract of an API served through `idemkit proxy` (`idemkit docs --proxy`).

use super::*;
use idemkit_tower::engine::Disposition;

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
}

/// The codes the proxy answers with, in the order its contract lists them.
const PROXY_CODES: [ErrorCode; 12] = [
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
    ErrorCode::Internal,
];

/// Renders the contract of an API served through `idemkit proxy`: the generic
/// parts of [`render`] (routes, key, windows, answers, retrying) from the
/// proxy's configuration, its problem codes, and what the proxy cannot promise
/// (`## Behind idemkit proxy`); none of the labels service's own sections.
pub fn render_proxy(proxy: &ProxyContract, client: &RetryConfig, format: Format) -> String {
    in_format(proxy_markdown(proxy, client), format)
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

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
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

    routes_table(w, &keyed, true);
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
        "if the proxy dies, a retry after the lease takes it over (see *When the outcome is unknown* below)",
    );
    let released: Vec<String> = (400..500)
        .filter(|s| Disposition::of(*s, None, &Policy::new()) == Disposition::Release)
        .map(|s| s.to_string())
        .collect();
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
            "{}, matched by method and path (a `{{name}}` segment matches any one segment; the path is compared \
             as sent, without case folding, trailing-slash or percent-decoding normalisation)",
            and_list(&keyed.iter().map(|r| r.route.clone()).collect::<Vec<_>>())
        ),
        None => format!(
            "every {} request, on any path",
            and_list(&PROXY_DEFAULT_METHODS.map(str::to_owned))
        ),
    };
    let five = {
        let retry = keyed
            .iter()
            .filter(|r| r.policy.on_server_error == ServerErrorPolicy::Retry)
            .count();
        if retry == keyed.len() {
            "passed to you and not stored: retry with the same key"
        } else if retry == 0 {
            "stored and replayed like any other answer"
        } else {
            "stored or not by the route's policy (*on 5xx* under *Routes*)"
        }
    };
    let gateway = if keyed
        .iter()
        .any(|r| r.policy.on_server_error == ServerErrorPolicy::Retry)
    {
        ", except a `502` or `504` that is not stored: that is an unknown outcome (*When the outcome is \
         unknown*)"
    } else {
        ""
    };
    let _ = writeln!(
        w,
        "- **Keyed routes:** {routes}. Every other request (and every `GET`, `HEAD`, `OPTIONS` and `TRACE`) is forwarded \
         untouched: no key is read and nothing is de-duplicated.\n\
         - **Exactly one non-empty `{credential}` header is required** on a keyed route: without it (or with \
         an empty one, or two) the proxy answers `{}` `{unauthorized}` and the request is never forwarded. The scope is a keyed hash (HMAC-SHA256) of the \
         header's value; the credential itself is never stored.\n\
         - **Your key is forwarded to the upstream as sent**, where you put it (header or body).\n\
         - **Answers.** Validation-class answers ({}) are not stored and free the key: the same key, with the request \
         corrected or not, is forwarded again. `5xx` answers are \
         {five}{gateway}. Every other answer is stored and replayed byte for byte, with `Idempotent-Replayed: true`; a \
         replay carries the stored status, body and the headers {}. `Set-Cookie` and hop-by-hop headers are \
         never stored.\n\
         - **Request size.** A keyed request body over **{}** is `{}` `{too_large}`; nothing is claimed or \
         forwarded.\n\
         - **The proxy's own paths**, `/healthz` and `/_idemkit/metrics`, are answered by the proxy and never \
         forwarded.\n\
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
         after the lease finds it). A connection that failed *before* sending is not one of them: you get `502` \
         `{internal}` (`retryable: {}`), nothing was sent, and a retry with the same key is forwarded again.\n",
        internal.retryable()
    );
    if proxy.upstream_honours_keys {
        let _ = writeln!(
            w,
            "This upstream de-duplicates by idempotency key itself, so **the same key is re-sent to the \
             upstream**. When the upstream timed out or failed after the request was sent, you get `502` or \
             `504` with `code` `{internal}`, `retryable: {}` and `Retry-After`: retry with the same key. That \
             retry (like a retry after the proxy died) is forwarded again with the same key, and the upstream's \
             own de-duplication makes it one effect.\n\n\
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
            ErrorCode::Internal if proxy.upstream_honours_keys => {
                format!("{}, 502, 504", code.default_status())
            }
            ErrorCode::Internal => format!("{}, 502", code.default_status()),
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
            ErrorCode::ValidationFailed => "the request body could not be read".to_owned(),
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
                "the proxy's key store failed: retry with the same key. Nothing was forwarded, unless it failed \
                 while storing the upstream's answer: that retry is then answered as *When the outcome is \
                 unknown* says"
                    .to_owned()
            }
            ErrorCode::ResponseTooLarge => {
                "the upstream's answer was too large to store; the key answers this from now on".to_owned()
            }
            _ if proxy.upstream_honours_keys => {
                "`502`: the upstream could not be reached (nothing was sent) or failed after the request was \
                 sent; `504`: it did not answer in time. Retry with the same key"
                    .to_owned()
            }
            _ => "`502`: the upstream could not be reached; nothing was sent; retry with the same key"
                .to_owned(),
        };
        let _ = writeln!(w, "| `{code}` | {status} | {} | {meaning} |", code.retryable());
    }
}
