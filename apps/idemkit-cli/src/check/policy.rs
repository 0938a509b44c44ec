//! `--policy`: reading the policy an endpoint publishes (its OpenAPI document with
//! `x-idempotency`, or its JSON policy document) into what the policy gate compares.

use std::time::Duration;

use anyhow::{Context, bail};
use http::Method;
use idemkit_check::{Expected, KeyPlacement, Published};
use idemkit_client::{KeyLocation, PublishedAnswer, PublishedPolicy};
use reqwest::Url;
use serde_json::Value;

/// Fetches the policy at `policy_url` and picks the operation `method target`.
pub(super) fn load(
    policy_url: &Url,
    method: &Method,
    target: &Url,
    timeout: Duration,
) -> anyhow::Result<Published> {
    let text = fetch(policy_url, timeout)?;
    let doc: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(&text).context("parsing JSON")?
    } else {
        yaml_serde::from_str(&text).context("parsing YAML")?
    };
    published(&doc, method, target, policy_url.as_str())
}

/// The published policy of `method target` in `doc`.
pub(super) fn published(
    doc: &Value,
    method: &Method,
    target: &Url,
    source: &str,
) -> anyhow::Result<Published> {
    let origin = target.origin().ascii_serialization();
    // The operation's path is published relative to a server URL that may carry a
    // base path (`servers: [{url: /v1}]`): try the origin, then each server's path.
    let mut bases = vec![origin.clone()];
    for server in doc.get("servers").and_then(Value::as_array).into_iter().flatten() {
        if let Some(u) = server.get("url").and_then(Value::as_str) {
            let path = Url::parse(u).map_or_else(|_| u.to_owned(), |u| u.path().to_owned());
            bases.push(format!("{origin}{}", path.trim_end_matches('/')));
        }
    }
    let mut found = None;
    for base in &bases {
        let policy = PublishedPolicy::from_document(base, doc)?;
        if let Some(op) = policy.operation(method, target.as_str()) {
            found = Some(op.clone());
            break;
        }
    }
    let Some(op) = found else {
        bail!(
            "{source} publishes no x-idempotency for {method} {}",
            target.path()
        );
    };
    if !op.retry_safe || op.safe {
        bail!(
            "{source} publishes {method} {} as {}: there is no key behaviour to compare",
            op.path,
            if op.safe {
                "a read (safe)"
            } else {
                "not retry-safe"
            }
        );
    }
    let key = match &op.key {
        Some(KeyLocation::Header(h)) => KeyPlacement::Header(h.clone()),
        Some(KeyLocation::Body(p)) => KeyPlacement::Field(p.clone()),
        // The gates send `Repeatability-First-Sent` with every keyed request
        // whose key header is `Repeatability-Request-ID`.
        Some(KeyLocation::Repeatability) => {
            KeyPlacement::Header(http::HeaderName::from_static("repeatability-request-id"))
        }
        Some(other) => bail!(
            "{source}: this checker does not know the key location {other:?} of {method} {}",
            op.path
        ),
        None => bail!("{source} publishes no key location for {method} {}", op.path),
    };
    let expected =
        |a: &Option<PublishedAnswer>| a.as_ref().map(|a| Expected::new(a.status, a.code.as_deref()));
    Ok(Published {
        key,
        replay_status: op.replay_status,
        replay_marker: op.replay_marker.clone(),
        mismatch: expected(&op.mismatch),
        in_progress: expected(&op.in_progress),
        duplicates_wait: op.in_flight.as_deref() == Some("wait"),
        retry_after: op.retry_after,
        key_missing: expected(&op.key_missing),
        key_invalid: expected(&op.key_invalid),
        source: format!("{source} ({method} {})", op.path),
    })
}

fn fetch(url: &Url, timeout: Duration) -> anyhow::Result<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let res = client
            .get(url.clone())
            .send()
            .await
            .with_context(|| format!("fetching {url}"))?;
        let status = res.status();
        if !status.is_success() {
            bail!("fetching {url}: the server answered {status}");
        }
        res.text().await.with_context(|| format!("reading {url}"))
    })
}

/// `idempotency-key` → `Idempotency-Key`, for messages.
pub(super) fn title(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use http::HeaderName;
    use serde_json::json;

    use super::*;

    #[test]
    fn the_operation_is_found_under_a_server_base_path() {
        let doc = json!({"openapi": "3.1.0", "servers": [{"url": "/v1"}], "paths": {"/labels": {"post": {"x-idempotency": {
            "key": {"in": "body", "name": "/idempotencyKey"},
            "conflicts": {"mismatch": {"status": 422, "code": "idempotency_key_reused"}},
            "replay": {"marker": {"header": "Idempotent-Replayed", "value": "true"}, "status": 200}}}}}});
        let target = Url::parse("http://127.0.0.1:9/v1/labels").unwrap();
        let p = published(&doc, &Method::POST, &target, "doc").unwrap();
        assert_eq!(p.key, KeyPlacement::Field("/idempotencyKey".into()));
        assert_eq!(
            p.mismatch,
            Some(Expected::new(422, Some("idempotency_key_reused")))
        );
        assert_eq!(p.replay_status, Some(200));
        assert_eq!(
            p.replay_marker,
            Some((HeaderName::from_static("idempotent-replayed"), "true".into()))
        );
        assert!(published(&doc, &Method::PUT, &target, "doc").is_err());
        assert_eq!(title("idempotency-key"), "Idempotency-Key");
    }
}
