//! The proxy's reading of `--config`: the service's TOML format, plus the
//! settings only a proxy needs (`not_executed`), taken out before the rest is
//! read as an [`IdemkitConfig`].

use std::collections::BTreeMap;

use crate::{ProxyError, error_chain};
use idemkit_tower::config::IdemkitConfig;

/// The proxy's `--config`: the idempotency configuration, and per keyed route
/// the upstream statuses the operator declared "not executed".
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The configuration as the service reads it.
    pub idemkit: IdemkitConfig,
    /// `"METHOD /path"` (as `[[routes]]` spells it, method upper-cased) → the
    /// `5xx` statuses the upstream answers only when it did nothing, so the key
    /// is freed on them. Every other answered `5xx` of an upstream that ignores
    /// keys is stored and replayed (`502`/`504`: parked).
    pub not_executed: BTreeMap<String, Vec<u16>>,
    /// `"METHOD /path"` → the response headers stored and replayed on that
    /// route on top of the policy's default allowlist (`replayed_headers`).
    pub replayed_headers: BTreeMap<String, Vec<String>>,
}

/// The proxy-only settings, on `[defaults]` (every route) and on a route.
const NOT_EXECUTED: &str = "not_executed";
const REPLAYED_HEADERS: &str = "replayed_headers";

impl ProxyConfig {
    /// Reads a `--config` file's text.
    pub fn from_toml(text: &str) -> Result<Self, ProxyError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ProxyError::invalid("invalid idemkit configuration", &e))?;
        let (defaults, default_headers) = match table.get_mut("defaults").and_then(|d| d.as_table_mut()) {
            Some(d) => (
                d.remove(NOT_EXECUTED)
                    .map(|v| statuses(&v, "[defaults]"))
                    .transpose()?,
                d.remove(REPLAYED_HEADERS)
                    .map(|v| headers(&v, "[defaults]"))
                    .transpose()?,
            ),
            None => (None, None),
        };
        let mut per_route = Vec::new();
        let mut per_route_headers = Vec::new();
        if let Some(routes) = table.get_mut("routes").and_then(|r| r.as_array_mut()) {
            for r in routes.iter_mut() {
                let Some(r) = r.as_table_mut() else {
                    per_route.push(None);
                    per_route_headers.push(None);
                    continue;
                };
                let what = format!(
                    "route {} {}",
                    r.get("method").and_then(|m| m.as_str()).unwrap_or("?"),
                    r.get("path").and_then(|m| m.as_str()).unwrap_or("?")
                );
                per_route.push(r.remove(NOT_EXECUTED).map(|v| statuses(&v, &what)).transpose()?);
                per_route_headers.push(
                    r.remove(REPLAYED_HEADERS)
                        .map(|v| headers(&v, &what))
                        .transpose()?,
                );
            }
        }
        let text = toml::to_string(&table).map_err(|e| ProxyError::Invalid(error_chain(&e)))?;
        let idemkit = IdemkitConfig::from_toml(&text).map_err(|e| ProxyError::Invalid(error_chain(&e)))?;
        let mut not_executed = BTreeMap::new();
        let mut replayed_headers = BTreeMap::new();
        for ((r, own), own_headers) in idemkit.routes.iter().zip(per_route).zip(per_route_headers) {
            if let Some(list) = own.or_else(|| defaults.clone())
                && !list.is_empty()
            {
                not_executed.insert(route_name(&r.method, &r.path), list);
            }
            if let Some(list) = own_headers.or_else(|| default_headers.clone())
                && !list.is_empty()
            {
                replayed_headers.insert(route_name(&r.method, &r.path), list);
            }
        }
        Ok(Self {
            idemkit,
            not_executed,
            replayed_headers,
        })
    }

    /// The extra replayed headers of the route `method path`.
    pub fn replayed_headers(&self, method: &str, path: &str) -> &[String] {
        self.replayed_headers
            .get(&route_name(method, path))
            .map_or(&[], Vec::as_slice)
    }

    /// The statuses declared "not executed" on the route `method path`.
    pub fn not_executed(&self, method: &str, path: &str) -> &[u16] {
        self.not_executed
            .get(&route_name(method, path))
            .map_or(&[], Vec::as_slice)
    }
}

/// How [`ProxyConfig::not_executed`] names a route.
pub fn route_name(method: &str, path: &str) -> String {
    format!("{} {path}", method.to_ascii_uppercase())
}

fn headers(v: &toml::Value, what: &str) -> Result<Vec<String>, ProxyError> {
    let list = v.as_array().ok_or_else(|| {
        ProxyError::Invalid(format!(
            "{what}: {REPLAYED_HEADERS} must be a list of header names"
        ))
    })?;
    let mut out = Vec::new();
    for h in list {
        let name = h
            .as_str()
            .filter(|n| http::HeaderName::from_bytes(n.as_bytes()).is_ok())
            .ok_or_else(|| {
                ProxyError::Invalid(format!("{what}: {REPLAYED_HEADERS} lists {h}, not a header name"))
            })?;
        out.push(name.to_ascii_lowercase());
    }
    Ok(out)
}

fn statuses(v: &toml::Value, what: &str) -> Result<Vec<u16>, ProxyError> {
    let list = v.as_array().ok_or_else(|| {
        ProxyError::Invalid(format!("{what}: {NOT_EXECUTED} must be a list of 5xx statuses"))
    })?;
    let mut out = Vec::new();
    for s in list {
        let n = s.as_integer().filter(|n| (500..600).contains(n)).ok_or_else(|| {
            ProxyError::Invalid(format!("{what}: {NOT_EXECUTED} lists {s}, not a 5xx status"))
        })?;
        out.push(n as u16);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_executed_is_read_per_route_and_removed_before_the_service_format() {
        let c = ProxyConfig::from_toml(
            "[defaults]\nnot_executed = [503]\n\
             [[routes]]\nmethod = \"post\"\npath = \"/a\"\n\
             [[routes]]\nmethod = \"POST\"\npath = \"/b\"\nnot_executed = [500, 503]\n\
             [[routes]]\nmethod = \"POST\"\npath = \"/c\"\nnot_executed = []\n",
        )
        .unwrap();
        assert_eq!(c.not_executed("POST", "/a"), [503]);
        assert_eq!(c.not_executed("POST", "/b"), [500, 503]);
        assert!(c.not_executed("POST", "/c").is_empty());
        let h = ProxyConfig::from_toml(
            "[[routes]]\nmethod = \"POST\"\npath = \"/a\"\nreplayed_headers = [\"ETag\", \"cache-control\"]\n",
        )
        .unwrap();
        assert_eq!(h.replayed_headers("POST", "/a"), ["etag", "cache-control"]);
        assert!(
            ProxyConfig::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"/a\"\nnot_executed = [404]\n")
                .is_err()
        );
        assert!(ProxyConfig::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"/a\"\nbogus = 1\n").is_err());
    }
}
