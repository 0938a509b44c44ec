//! One configuration format (TOML) for the idempotency policy of every route, read
//! by the library and by services, and the source the integrator contract is
//! generated from, so published numbers are the running ones.
//!
//! ```
//! use idemkit_tower::config::IdemkitConfig;
//! let config = IdemkitConfig::from_toml(r#"
//!     [defaults]
//!     replay_window = "24h"
//!     reap_threshold = "72h"
//!     lease = "30s"
//!
//!     [[routes]]
//!     method = "POST"
//!     path = "/labels"
//!     key_field = "/idempotencyKey"
//!     replay_status = 200
//!     longest_retry_chain = "1h"
//! "#).unwrap();
//! let route = config.route("POST", "/labels").unwrap();
//! assert_eq!(route.policy().replay_status, Some(200));
//! ```

use std::time::Duration;

use idemkit_core::{
    ErrorCode, InFlightBehavior, MAX_KEY_LEN, MismatchStatus, Policy, PolicyError, ServerErrorPolicy,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The version of the `x-idempotency` vocabulary this crate writes
/// (`docs/x-idempotency.md`).
pub const X_IDEMPOTENCY_VERSION: u64 = 1;

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct IdemkitConfig {
    /// Policy every route starts from.
    #[serde(default)]
    pub defaults: RouteDefaults,
    /// The routes.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// What the service serves besides its routes (gRPC, an OpenAPI document,
    /// the contract routes): what its published contract may point callers to.
    #[serde(default)]
    pub service: ServiceConfig,
}

/// How a route's layer runs its requests: the constructor the service builds
/// the layer with (`IdempotencyLayer::builder` or `IdempotencyLayer::transactional`).
/// The configuration *describes* it, so the published contract says what a
/// hang-up or a passed deadline does on each route; it does not choose it
/// ([`RouteConfig::configure`] applies the policy to whichever builder it gets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Lease mode (`IdempotencyLayer::builder`): the claim commits at once with
    /// a lease; the request runs to its end detached from the connection, is
    /// never cut short by the caller's deadline, and stores its answer for the
    /// retry. The default: it promises the least (a caller told "rolled back"
    /// about a request that in fact ran could repeat it under a new key).
    #[default]
    Lease,
    /// Single-step (`IdempotencyLayer::transactional`, SQL stores): claim,
    /// business writes and answer commit in one transaction; a hang-up or a
    /// passed deadline rolls it back (`504 deadline_exceeded` for the deadline)
    /// and frees the key.
    SingleStep,
}

impl Mode {
    /// The name the configuration and the contract use (`lease`, `single_step`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lease => "lease",
            Self::SingleStep => "single_step",
        }
    }
}

/// What the service serves besides its keyed routes; every key is optional and
/// off by default, so a contract never points callers to an endpoint the
/// service does not have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ServiceConfig {
    /// The same routes are also served over gRPC (`idemkit-tonic`, always lease
    /// mode): the contract says how the deadline travels there.
    pub grpc: bool,
    /// The path of the service's OpenAPI document, whose keyed operations
    /// carry `x-idempotency` (`"/openapi.json"`).
    pub openapi: Option<String>,
    /// The service serves this contract with `idemkit_contract::router`
    /// (`GET /docs/idempotency` and `GET /docs/idempotency.json`).
    pub contract_routes: bool,
}

/// What a route does with a request still in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum InFlight {
    /// `409 idempotency_request_in_progress` with `Retry-After`.
    #[default]
    Reject,
    /// Wait up to `in_flight_wait`, then replay (or 409).
    Wait,
    /// `202` with a status URL.
    Accepted,
}

/// What a route does with its handler's `5xx` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ServerErrors {
    /// Not stored; the retry runs again (resuming from its recovery point).
    #[default]
    Retry,
    /// Stored and replayed.
    Replay,
}

/// Which key convention a route speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum KeyConvention {
    /// `Idempotency-Key` (or the configured `key_header`), or the JSON body
    /// field `key_field`.
    #[default]
    IdempotencyKey,
    /// OASIS Repeatable Requests 1.0: `Repeatability-Request-ID` is the key,
    /// `Repeatability-First-Sent` is required and must be inside the replay
    /// window (else `412`), answers carry `Repeatability-Result`.
    Repeatability,
}

/// Policy settings a route inherits unless it overrides them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteDefaults {
    /// How long a completed key replays.
    #[serde(with = "humantime_serde")]
    pub replay_window: Duration,
    /// How long records are kept for humans.
    #[serde(with = "humantime_serde")]
    pub reap_threshold: Duration,
    /// Lease of a claim, extended by heartbeats.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// In-flight behaviour.
    pub in_flight: InFlight,
    /// How long `in_flight = "wait"` waits.
    #[serde(with = "humantime_serde")]
    pub in_flight_wait: Duration,
    /// `5xx` policy.
    pub server_errors: ServerErrors,
    /// Status of a payload mismatch: 409 or 422.
    pub mismatch_status: u16,
    /// The key header.
    pub key_header: String,
    /// Largest response stored for replay, in bytes.
    pub max_stored_body: usize,
    /// How the routes' layers run requests (see [`Mode`]).
    pub mode: Mode,
}

impl Default for RouteDefaults {
    fn default() -> Self {
        let p = Policy::new();
        Self {
            replay_window: p.replay_window,
            reap_threshold: p.reap_threshold,
            lease: p.lease,
            in_flight: InFlight::Reject,
            in_flight_wait: Duration::from_secs(5),
            server_errors: ServerErrors::Retry,
            mismatch_status: 409,
            key_header: "Idempotency-Key".into(),
            max_stored_body: p.max_stored_body,
            mode: Mode::Lease,
        }
    }
}

/// One route.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RouteConfig {
    /// HTTP method.
    pub method: String,
    /// Path, as routed (`/labels`, `/orders/{id}/confirm`).
    pub path: String,
    /// `false` for a mutating route that takes no key and is documented as not
    /// retry-safe.
    #[serde(default = "yes")]
    pub retry_safe: bool,
    /// Read the key from this JSON body field (a JSON pointer) instead of the header.
    #[serde(default)]
    pub key_field: Option<String>,
    /// The key convention (`key = "repeatability"` for OASIS Repeatable Requests).
    #[serde(default)]
    pub key: KeyConvention,
    /// Response headers stored and replayed besides the defaults
    /// (`content-type`, `location`, `content-language`, `content-encoding`),
    /// e.g. `["etag", "cache-control", "link"]`. `set-cookie`, hop-by-hop
    /// headers, `date` and `content-length` are refused at load.
    #[serde(default)]
    pub replay_headers: Vec<String>,
    /// Replays of a stored 2xx answer with this status.
    #[serde(default)]
    pub replay_status: Option<u16>,
    /// The longest retry chain clients use here; the replay window must cover it.
    #[serde(default, with = "humantime_serde")]
    pub longest_retry_chain: Option<Duration>,
    /// Overrides of the defaults.
    #[serde(default, with = "humantime_serde")]
    pub replay_window: Option<Duration>,
    /// Overrides the lease.
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
    /// Overrides the `5xx` policy.
    #[serde(default)]
    pub server_errors: Option<ServerErrors>,
    /// Overrides the in-flight behaviour.
    #[serde(default)]
    pub in_flight: Option<InFlight>,
    /// Overrides the mode the route's layer runs in (see [`Mode`]).
    #[serde(default)]
    pub mode: Option<Mode>,
    /// A sentence for integrators about what this route does.
    #[serde(default)]
    pub description: Option<String>,
    #[serde(skip)]
    defaults: RouteDefaults,
}

fn yes() -> bool {
    true
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigFileError {
    /// Not valid TOML for this format.
    #[error("invalid idemkit configuration: {0}")]
    Parse(#[from] toml::de::Error),
    /// A route's policy breaks the contract.
    #[error("route {method} {path}: {source}")]
    Policy {
        /// Route method.
        method: String,
        /// Route path.
        path: String,
        /// Why.
        source: PolicyError,
    },
    /// Any other inconsistency.
    #[error("invalid idemkit configuration: {0}")]
    Invalid(String),
}

impl RouteConfig {
    /// The route's effective policy.
    pub fn policy(&self) -> Policy {
        let d = &self.defaults;
        let mut p = Policy::new()
            .with_replay_window(self.replay_window.unwrap_or(d.replay_window))
            .with_reap_threshold(d.reap_threshold)
            .with_lease(self.lease.unwrap_or(d.lease))
            .with_max_stored_body(d.max_stored_body)
            .with_mismatch_status(if d.mismatch_status == 422 {
                MismatchStatus::UnprocessableContent
            } else {
                MismatchStatus::Conflict
            })
            .with_server_error_policy(match self.server_errors.unwrap_or(d.server_errors) {
                ServerErrors::Retry => ServerErrorPolicy::Retry,
                ServerErrors::Replay => ServerErrorPolicy::Replay,
            })
            .with_in_flight(match self.in_flight.unwrap_or(d.in_flight) {
                InFlight::Reject => InFlightBehavior::Reject,
                InFlight::Wait => InFlightBehavior::Wait(d.in_flight_wait),
                InFlight::Accepted => InFlightBehavior::Accepted,
            });
        if let Some(s) = self.replay_status {
            p = p.with_replay_status(s);
        }
        if let Some(c) = self.longest_retry_chain {
            p = p.with_longest_retry_chain(c);
        }
        for h in &self.replay_headers {
            p = p.with_replayed_header(h.trim());
        }
        p
    }

    /// The mode the route's layer runs in: its own `mode`, else `[defaults]`.
    pub fn mode(&self) -> Mode {
        self.mode.unwrap_or(self.defaults.mode)
    }

    /// Every response header the route stores and replays (when the answer has
    /// it), lower-case: the defaults, then the configured ones.
    pub fn replayed_headers(&self) -> Vec<String> {
        let mut all: Vec<String> = idemkit_core::DEFAULT_REPLAYED_HEADERS
            .iter()
            .map(|h| (*h).to_owned())
            .collect();
        for h in self.policy().replayed_headers {
            if !all.contains(&h) {
                all.push(h);
            }
        }
        all
    }

    /// The key header of the route (when it does not read a body field).
    pub fn key_header(&self) -> &str {
        &self.defaults.key_header
    }

    /// The route's published policy: the `x-idempotency` object of its OpenAPI
    /// operation (`docs/x-idempotency.md`), generated from the same configuration the
    /// layer runs with. A route with `retry_safe = false` publishes only that.
    ///
    /// ```
    /// use idemkit_tower::config::IdemkitConfig;
    /// let config = IdemkitConfig::from_toml(
    ///     "[[routes]]\nmethod = \"POST\"\npath = \"/labels\"\nkey_field = \"/idempotencyKey\"\nreplay_status = 200\n",
    /// ).unwrap();
    /// let x = config.route("POST", "/labels").unwrap().x_idempotency();
    /// assert_eq!(x["key"]["in"], "body");
    /// assert_eq!(x["key"]["name"], "/idempotencyKey");
    /// assert_eq!(x["replay"]["status"], 200);
    /// assert_eq!(x["conflicts"]["mismatch"]["code"], "idempotency_key_reused");
    /// ```
    pub fn x_idempotency(&self) -> Value {
        if !self.retry_safe {
            return json!({ "version": X_IDEMPOTENCY_VERSION, "retrySafe": false });
        }
        let p = self.policy();
        let key = match (&self.key_field, self.key) {
            (_, KeyConvention::Repeatability) => json!({
                "in": "header",
                "name": "Repeatability-Request-ID",
                "convention": "oasis-repeatable-requests-1.0",
                "firstSent": {
                    "header": "Repeatability-First-Sent",
                    "format": "HTTP-date (IMF-fixdate)",
                    "required": true,
                    "maxAgeSeconds": secs(p.replay_window),
                    "maxAheadSeconds": crate::REPEATABILITY_CLOCK_SKEW.as_secs(),
                },
                "result": {
                    "header": "Repeatability-Result",
                    "accepted": "the request ran, or its first answer is replayed",
                    "rejected": "refused because of its repeatability headers (missing, malformed, out of window, reused with another request, in progress)",
                },
            }),
            (Some(pointer), _) => json!({ "in": "body", "name": pointer }),
            (None, _) => json!({ "in": "header", "name": self.key_header() }),
        };
        let mut key = key;
        key["required"] = json!(true);
        key["minLength"] = json!(1);
        key["maxLength"] = json!(MAX_KEY_LEN);
        key["pattern"] = json!(format!("^[\\x21-\\x7E]{{1,{MAX_KEY_LEN}}}$"));
        let in_flight = match p.in_flight {
            InFlightBehavior::Wait(d) => json!({ "behavior": "wait", "maxWaitSeconds": secs(d) }),
            InFlightBehavior::Accepted => json!({ "behavior": "accepted", "status": 202 }),
            _ => json!({ "behavior": "reject" }),
        };
        let conflict = |code: ErrorCode, status: u16| json!({ "status": status, "code": code.as_str() });
        let mut excludes = Vec::new();
        if let Some(pointer) = &self.key_field {
            excludes.push(pointer.clone());
        }
        let mut x = json!({
            "version": X_IDEMPOTENCY_VERSION,
            "retrySafe": true,
            "key": key,
            "scope": "account",
            "fingerprint": {
                "covers": ["method", "path", "query", "body"],
                "json": "RFC 8785 canonical form, numbers kept digit for digit",
                "excludes": excludes,
            },
            "replayWindowSeconds": secs(p.replay_window),
            "reapThresholdSeconds": secs(p.reap_threshold),
            "leaseSeconds": secs(p.lease),
            "longestRetryChainSeconds": p.longest_retry_chain.map(secs),
            "inFlight": in_flight,
            "conflicts": {
                "mismatch": conflict(ErrorCode::KeyReused, p.mismatch_status.as_u16()),
                "inProgress": {
                    "status": 409,
                    "code": ErrorCode::RequestInProgress.as_str(),
                    "retryAfter": true,
                },
                "missing": conflict(ErrorCode::KeyMissing, 400),
                "invalid": conflict(ErrorCode::KeyInvalid, 400),
            },
            "replay": {
                "marker": { "header": "Idempotent-Replayed", "value": "true" },
                "status": p.replay_status,
                "identicalBody": true,
                "headers": self.replayed_headers(),
                "neverHeaders": idemkit_core::NEVER_REPLAYED_HEADERS,
                "contentEncoding": {
                    "stored": true,
                    "notAccepted": conflict(ErrorCode::ReplayNotAcceptable, 406),
                },
            },
            "streaming": {
                "stored": false,
                "contentTypes": ["text/event-stream"],
                "answer": conflict(ErrorCode::StreamingUnsupported, 500),
            },
            "serverErrors": match p.on_server_error {
                ServerErrorPolicy::Replay => "replay",
                _ => "retry",
            },
            "validationErrors": "released",
            "maxStoredBodyBytes": p.max_stored_body,
        });
        if self.key == KeyConvention::Repeatability {
            x["conflicts"]["firstSentOutOfWindow"] = conflict(ErrorCode::FirstSentOutOfWindow, 412);
        }
        x
    }

    /// Applies the route's policy and key source to a layer builder.
    pub fn configure(
        &self,
        builder: crate::IdempotencyLayerBuilder,
    ) -> Result<crate::IdempotencyLayerBuilder, ConfigFileError> {
        let builder = builder.policy(self.policy());
        if self.key == KeyConvention::Repeatability {
            return Ok(builder.repeatability());
        }
        Ok(match &self.key_field {
            Some(field) => builder.key_json_field(field.clone()),
            None => builder.key_header(
                http::HeaderName::try_from(self.key_header())
                    .map_err(|e| ConfigFileError::Invalid(format!("key_header: {e}")))?,
            ),
        })
    }
}

impl IdemkitConfig {
    /// Parses and validates a configuration; invalid combinations are refused with
    /// a message naming the route and the rule.
    pub fn from_toml(text: &str) -> Result<Self, ConfigFileError> {
        let mut config: Self = toml::from_str(text)?;
        config.finish()?;
        Ok(config)
    }

    fn finish(&mut self) -> Result<(), ConfigFileError> {
        if !matches!(self.defaults.mismatch_status, 409 | 422) {
            return Err(ConfigFileError::Invalid(format!(
                "mismatch_status must be 409 or 422, not {}",
                self.defaults.mismatch_status
            )));
        }
        for r in &mut self.routes {
            r.defaults = self.defaults.clone();
            r.method = r.method.to_ascii_uppercase();
            if r.retry_safe {
                r.policy().validate().map_err(|source| ConfigFileError::Policy {
                    method: r.method.clone(),
                    path: r.path.clone(),
                    source,
                })?;
            }
            for h in &mut r.replay_headers {
                *h = h.trim().to_ascii_lowercase();
                if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                    return Err(ConfigFileError::Invalid(format!(
                        "route {} {}: replay_headers: `{h}` is not a header name",
                        r.method, r.path
                    )));
                }
            }
            if r.key == KeyConvention::Repeatability && r.key_field.is_some() {
                return Err(ConfigFileError::Invalid(format!(
                    "route {} {}: `key = \"repeatability\"` reads the key from `Repeatability-Request-ID`; remove `key_field`",
                    r.method, r.path
                )));
            }
            if let Some(f) = &r.key_field
                && !f.starts_with('/')
            {
                return Err(ConfigFileError::Invalid(format!(
                    "route {} {}: key_field must be a JSON pointer",
                    r.method, r.path
                )));
            }
        }
        Ok(())
    }

    /// The route with this method and path.
    pub fn route(&self, method: &str, path: &str) -> Option<&RouteConfig> {
        self.routes
            .iter()
            .find(|r| r.method.eq_ignore_ascii_case(method) && r.path == path)
    }

    /// The policy document served next to the integrator contract
    /// (`/docs/idempotency.json` on the labels service): every route's
    /// `x-idempotency`, by method and path.
    pub fn policy_document(&self) -> Value {
        json!({
            "version": X_IDEMPOTENCY_VERSION,
            "operations": self.routes.iter().map(|r| json!({
                "method": r.method,
                "path": r.path,
                "x-idempotency": r.x_idempotency(),
            })).collect::<Vec<_>>(),
        })
    }

    /// Overrides the lease of every route (a service's `--lease-ms` flag), so the
    /// configuration keeps describing what runs.
    pub fn with_lease(mut self, lease: Duration) -> Result<Self, ConfigFileError> {
        self.defaults.lease = lease;
        for r in &mut self.routes {
            r.lease = None;
        }
        self.finish()?;
        Ok(self)
    }
}

/// Whole seconds (rounded up: a published window is never shorter than the real one).
fn secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_idempotency_follows_the_route() {
        let c = IdemkitConfig::from_toml(
            "[defaults]\nmismatch_status = 422\nlease = \"1500ms\"\nin_flight = \"wait\"\n\
             [[routes]]\nmethod = \"POST\"\npath = \"/x\"\nserver_errors = \"replay\"\n\
             [[routes]]\nmethod = \"POST\"\npath = \"/legacy\"\nretry_safe = false\n",
        )
        .unwrap();
        let x = c.route("POST", "/x").unwrap().x_idempotency();
        assert_eq!(
            x["key"],
            json!({"in": "header", "name": "Idempotency-Key", "required": true, "minLength": 1, "maxLength": 255, "pattern": "^[\\x21-\\x7E]{1,255}$"})
        );
        assert_eq!(
            x["conflicts"]["mismatch"],
            json!({"status": 422, "code": "idempotency_key_reused"})
        );
        assert_eq!(x["leaseSeconds"], 2);
        assert_eq!(x["inFlight"], json!({"behavior": "wait", "maxWaitSeconds": 5}));
        assert_eq!(x["serverErrors"], "replay");
        assert_eq!(x["replay"]["status"], Value::Null);
        assert_eq!(
            c.route("POST", "/legacy").unwrap().x_idempotency(),
            json!({"version": 1, "retrySafe": false})
        );
        let doc = c.policy_document();
        assert_eq!(doc["operations"][1]["path"], "/legacy");
        assert_eq!(doc["operations"][0]["x-idempotency"], x);
    }

    #[test]
    fn replay_headers_are_configured_published_and_never_forbidden_ones() {
        let c = IdemkitConfig::from_toml(
            "[[routes]]\nmethod = \"POST\"\npath = \"/x\"\nreplay_headers = [\"ETag\", \"cache-control\", \"link\"]\n",
        )
        .unwrap();
        let r = c.route("POST", "/x").unwrap();
        assert!(r.policy().replays_header("etag"));
        assert!(r.policy().replays_header("Cache-Control"));
        assert_eq!(
            r.x_idempotency()["replay"]["headers"],
            json!([
                "content-type",
                "location",
                "content-language",
                "content-encoding",
                "etag",
                "cache-control",
                "link"
            ])
        );
        for bad in [
            "set-cookie",
            "Set-Cookie",
            "connection",
            "transfer-encoding",
            "date",
            "keep-alive",
            "upgrade",
        ] {
            let err = IdemkitConfig::from_toml(&format!(
                "[[routes]]\nmethod = \"POST\"\npath = \"/x\"\nreplay_headers = [\"etag\", \"{bad}\"]\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("POST /x") && err.contains("can never be replayed"),
                "{bad}: {err}"
            );
        }
        let err = IdemkitConfig::from_toml(
            "[[routes]]\nmethod = \"POST\"\npath = \"/x\"\nreplay_headers = [\"bad header\"]\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a header name"), "{err}");
    }

    #[test]
    fn repeatability_is_a_route_convention() {
        let c = IdemkitConfig::from_toml(
            "[[routes]]\nmethod = \"POST\"\npath = \"/r\"\nkey = \"repeatability\"\nreplay_window = \"5m\"\n",
        )
        .unwrap();
        let x = c.route("POST", "/r").unwrap().x_idempotency();
        assert_eq!(x["key"]["in"], "header");
        assert_eq!(x["key"]["name"], "Repeatability-Request-ID");
        assert_eq!(x["key"]["convention"], "oasis-repeatable-requests-1.0");
        assert_eq!(x["key"]["firstSent"]["header"], "Repeatability-First-Sent");
        assert_eq!(x["key"]["firstSent"]["maxAgeSeconds"], 300);
        assert_eq!(
            x["conflicts"]["firstSentOutOfWindow"],
            json!({"status": 412, "code": "repeatability_first_sent_out_of_window"})
        );
        assert!(
            IdemkitConfig::from_toml(
                "[[routes]]\nmethod = \"POST\"\npath = \"/r\"\nkey = \"repeatability\"\nkey_field = \"/k\"\n"
            )
            .is_err()
        );
    }

    #[test]
    fn defaults_are_the_library_defaults() {
        let c = IdemkitConfig::from_toml("[[routes]]\nmethod = \"post\"\npath = \"/x\"\n").unwrap();
        assert_eq!(c.route("POST", "/x").unwrap().policy(), Policy::new());
    }

    #[test]
    fn invalid_combinations_are_refused_with_the_route_named() {
        let err = IdemkitConfig::from_toml(
            "[defaults]\nreplay_window = \"10m\"\n[[routes]]\nmethod = \"POST\"\npath = \"/x\"\nlongest_retry_chain = \"1h\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("POST /x"), "{err}");
        assert!(err.to_string().contains("retry chain"), "{err}");
        assert!(
            IdemkitConfig::from_toml(
                "[defaults]\nlease = \"48h\"\n[[routes]]\nmethod = \"POST\"\npath = \"/x\"\n"
            )
            .is_err()
        );
        assert!(IdemkitConfig::from_toml("[defaults]\nmismatch_status = 418\n").is_err());
        assert!(
            IdemkitConfig::from_toml("[defaults]\nwat = 1\n").is_err(),
            "unknown fields are refused"
        );
    }
}
