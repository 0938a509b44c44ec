//! An in-memory keyed endpoint for the gates' unit tests: `POST /things` with the
//! key in `Idempotency-Key` and the account in `Authorization`, `GET /count`
//! counting effects per account or for everyone.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use http::{HeaderMap, HeaderValue};

use crate::{Answer, Request, Transport, TransportError};

/// How the fake endpoint behaves.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Behaviour {
    /// `GET /count` answers every account's effects together.
    pub(crate) shared_count: bool,
    /// Keys are stored without the account: another account's same key is a
    /// replay of the first account's answer.
    pub(crate) unscoped_keys: bool,
    /// The mismatch status (409 by default).
    pub(crate) mismatch_status: Option<u16>,
}

#[derive(Default)]
struct State {
    effects: HashMap<String, i64>,
    stored: HashMap<(String, String), (Vec<u8>, Answer)>,
}

pub(crate) struct Fake {
    behaviour: Behaviour,
    state: Mutex<State>,
}

pub(crate) const URL: &str = "http://fake.test/things";
pub(crate) const COUNT_URL: &str = "http://fake.test/count";

fn answer(status: u16, body: String, replay: bool) -> Answer {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    if replay {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Answer {
        status,
        headers,
        body: body.into_bytes(),
    }
}

fn problem(status: u16, code: &str) -> Answer {
    answer(status, format!(r#"{{"code":"{code}"}}"#), false)
}

impl Fake {
    pub(crate) fn new(behaviour: Behaviour) -> Self {
        Self {
            behaviour,
            state: Mutex::new(State::default()),
        }
    }
}

#[async_trait]
impl Transport for Fake {
    async fn send(&self, request: Request) -> Result<Answer, TransportError> {
        let account = request
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let mut state = self.state.lock().unwrap();
        if request.url == COUNT_URL {
            let n = if self.behaviour.shared_count {
                state.effects.values().sum()
            } else {
                state.effects.get(&account).copied().unwrap_or(0)
            };
            return Ok(answer(200, format!(r#"{{"count":{n}}}"#), false));
        }
        let Some(key) = request.headers.get("idempotency-key") else {
            return Ok(problem(400, "idempotency_key_missing"));
        };
        let key = key.to_str().unwrap_or("\t").to_owned();
        if key.is_empty() || key.len() > 255 || key.chars().any(|c| c.is_control()) {
            return Ok(problem(400, "idempotency_key_invalid"));
        }
        let scope = if self.behaviour.unscoped_keys {
            String::new()
        } else {
            account.clone()
        };
        let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap_or_default();
        let fingerprint = serde_json::to_vec(&body).unwrap();
        // Validation first, as the labels service does: an invalid body under a
        // used key is a validation error, not a mismatch.
        if body.get("sku").and_then(|s| s.as_str()) == Some("INVALID") {
            return Ok(problem(400, "validation_failed"));
        }
        if let Some((stored_fingerprint, stored)) = state.stored.get(&(scope.clone(), key.clone())) {
            if *stored_fingerprint != fingerprint {
                return Ok(problem(
                    self.behaviour.mismatch_status.unwrap_or(409),
                    "idempotency_key_reused",
                ));
            }
            let mut replay = stored.clone();
            replay
                .headers
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            return Ok(replay);
        }
        let n: i64 = state.effects.values().sum::<i64>() + 1;
        *state.effects.entry(account).or_default() += 1;
        let created = answer(201, format!(r#"{{"id":{n}}}"#), false);
        state.stored.insert((scope, key), (fingerprint, created.clone()));
        Ok(created)
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, Method};

    use super::*;
    use crate::{CheckConfig, Expected, Gate, KeyPlacement, Published, Template, Verdict};

    fn config(alt: &str) -> CheckConfig {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer one"));
        let template = Template::new(Method::POST, URL)
            .with_headers(headers)
            .with_body(br#"{"sku":"BOOK-1","quantity":1}"#)
            .unwrap()
            .with_alt_body(alt.as_bytes())
            .unwrap();
        CheckConfig::new(template)
            .with_count_url(COUNT_URL)
            .with_other_account(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer two"),
            )
    }

    async fn verdict(behaviour: Behaviour, config: CheckConfig, gate: Gate) -> (Verdict, String) {
        let report = crate::run(&config.with_gates([gate]), &Fake::new(behaviour), &()).await;
        let g = &report.gates[0];
        (g.verdict, format!("{}; {:?}", g.evidence, g.details))
    }

    const ALT: &str = r#"{"sku":"BOOK-2","quantity":1}"#;

    /// A probe that counts for everyone: isolation judges the
    /// total instead of failing a correct endpoint, and still fails an unscoped one.
    #[tokio::test]
    async fn isolation_with_a_shared_count_judges_the_total() {
        for shared_count in [false, true] {
            let ok = Behaviour {
                shared_count,
                ..Behaviour::default()
            };
            let (v, evidence) = verdict(ok, config(ALT), Gate::Isolation).await;
            assert_eq!(v, Verdict::Pass, "shared {shared_count}: {evidence}");
            assert_eq!(
                evidence.contains("judged by the total"),
                shared_count,
                "{evidence}"
            );
            let broken = Behaviour {
                unscoped_keys: true,
                ..ok
            };
            let (v, evidence) = verdict(broken, config(ALT), Gate::Isolation).await;
            assert_eq!(v, Verdict::Fail, "shared {shared_count}: {evidence}");
            assert!(evidence.contains("got a replay"), "{evidence}");
        }
    }

    fn published() -> Published {
        Published {
            key: KeyPlacement::default(),
            replay_status: None,
            replay_marker: Some((HeaderName::from_static("idempotent-replayed"), "true".into())),
            mismatch: Some(Expected::new(409, Some("idempotency_key_reused"))),
            in_progress: Some(Expected::new(409, Some("idempotency_request_in_progress"))),
            duplicates_wait: true,
            retry_after: true,
            key_missing: Some(Expected::new(400, Some("idempotency_key_missing"))),
            key_invalid: Some(Expected::new(400, Some("idempotency_key_invalid"))),
            source: "test".into(),
        }
    }

    /// Gate 9 agrees with gate 3: a second body refused on its own too is no
    /// evidence about mismatches (inconclusive), while a real difference from
    /// the published mismatch answer still fails.
    #[tokio::test]
    async fn policy_gate_does_not_fail_on_a_second_body_that_is_invalid_alone() {
        let invalid = r#"{"sku":"INVALID","quantity":1}"#;
        let ok = Behaviour::default();
        let (v, evidence) = verdict(ok, config(invalid), Gate::Mismatch).await;
        assert_eq!(v, Verdict::Inconclusive, "{evidence}");
        let (v, evidence) = verdict(ok, config(invalid).with_published(published()), Gate::Policy).await;
        assert_eq!(v, Verdict::Inconclusive, "{evidence}");
        assert!(evidence.contains("refused on its own too"), "{evidence}");
        let (v, evidence) = verdict(ok, config(ALT).with_published(published()), Gate::Policy).await;
        assert_eq!(v, Verdict::Pass, "{evidence}");
        let other = Behaviour {
            mismatch_status: Some(422),
            ..ok
        };
        let (v, evidence) = verdict(other, config(ALT).with_published(published()), Gate::Policy).await;
        assert_eq!(v, Verdict::Fail, "{evidence}");
        assert!(
            evidence.contains("mismatch: published 409 idempotency_key_reused, observed 422"),
            "{evidence}"
        );
    }
}
