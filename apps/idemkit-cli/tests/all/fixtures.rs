//! In-process fixture servers for `idemkit check`: one correct idempotent orders API
//! and the classic broken designs, each a small axum app on its own loopback port.
//!
//! Routes (every design):
//! - `POST /orders`: bearer account, key in `Idempotency-Key`, body
//!   `{"sku": string, "quantity": integer ≥ 1}` → `201` + `Location` + the order;
//!   replays carry `Idempotent-Replayed: true`.
//! - `POST /payments`: the same, with the key in the body at `/idempotencyKey`
//!   (left out of the fingerprint) and replays answering `200`.
//! - `GET /orders/count`: `{"count": n}` orders made for the caller's account.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// How long the work behind a first request takes: the in-flight window.
const WORK: Duration = Duration::from_millis(40);
/// The check-then-insert gap of the TOCTOU design.
const GAP: Duration = Duration::from_millis(50);
/// The work of the waiting design: long enough that a duplicate's wait shows.
const SLOW_WORK: Duration = Duration::from_millis(300);

/// Which implementation a fixture serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Design {
    /// Atomic claim, in-flight state with `409 idempotency_request_in_progress` +
    /// `Retry-After`, fingerprint, keys scoped by account, faithful replay.
    Correct,
    /// Correct, but claim, work and completion happen under one lock with no await
    /// between them: a duplicate can never overlap the original.
    Instant,
    /// Correct, in wait mode: a duplicate of a running request waits for it and gets
    /// the replay; the work is slow.
    Waiting,
    /// Check-then-insert: look the key up, then (after a gap) insert it (TOCTOU).
    Toctou,
    /// No fingerprint: a different body under a used key replays the original.
    NoFingerprint,
    /// Keys scoped by key alone, not by (account, key).
    Unscoped,
    /// Binary seen/unseen: no in-flight state; a duplicate of a request still running
    /// is told the key was already used, like a reused key.
    Binary,
    /// A new key is acknowledged (`201` with an order) but never stored or applied.
    NeverApplied,
    /// Only the body is stored: replays lose `Location` and the content type.
    LossyReplay,
    /// Keys are not validated: missing, empty, oversized or control-character keys
    /// are processed (a missing key means no idempotency at all).
    LaxKeys,
}

#[derive(Clone)]
struct Stored {
    status: StatusCode,
    body: Vec<u8>,
    location: String,
}

#[derive(Clone)]
enum Record {
    InFlight { fingerprint: Value },
    Done { fingerprint: Value, response: Stored },
}

struct App {
    design: Design,
    records: Mutex<HashMap<String, Record>>,
    counts: Mutex<HashMap<String, i64>>,
    next_id: AtomicI64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyIn {
    Header,
    Body,
}

/// A fixture on a loopback port; the server task ends with the test's runtime.
pub(crate) struct Fixture {
    pub(crate) base: String,
}

impl Fixture {
    pub(crate) async fn start(design: Design) -> Self {
        let app = Arc::new(App {
            design,
            records: Mutex::new(HashMap::new()),
            counts: Mutex::new(HashMap::new()),
            next_id: AtomicI64::new(1),
        });
        let router = Router::new()
            .route("/orders", post(orders))
            .route("/payments", post(payments))
            .route("/orders/count", get(count))
            .with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Self { base }
    }
}

fn problem(status: u16, code: &str, retry_after: bool) -> Response {
    let status = StatusCode::from_u16(status).unwrap();
    let body = json!({
        "type": format!("urn:fixture:{code}"),
        "title": code.replace('_', " "),
        "status": status.as_u16(),
        "detail": code.replace('_', " "),
        "code": code,
        "retryable": retry_after,
    });
    let mut res = (status, body.to_string()).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if retry_after {
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    res
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ").map(str::to_owned)
}

async fn orders(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    create(&app, &headers, &body, KeyIn::Header).await
}

async fn payments(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    create(&app, &headers, &body, KeyIn::Body).await
}

async fn count(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let Some(account) = bearer(&headers) else {
        return problem(401, "unauthorized", false);
    };
    let n = app.counts.lock().unwrap().get(&account).copied().unwrap_or(0);
    axum::Json(json!({ "count": n })).into_response()
}

/// SPEC §1: 1–255 visible ASCII characters.
fn valid_key(key: &str) -> bool {
    (1..=255).contains(&key.len()) && key.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

async fn create(app: &App, headers: &HeaderMap, body: &[u8], key_in: KeyIn) -> Response {
    let design = app.design;
    let Some(account) = bearer(headers) else {
        return problem(401, "unauthorized", false);
    };
    let Ok(mut fingerprint) = serde_json::from_slice::<Value>(body) else {
        return problem(400, "validation_failed", false);
    };
    let key: Option<String> = match key_in {
        KeyIn::Header => {
            let mut values = headers.get_all("idempotency-key").iter();
            match (values.next(), values.next()) {
                (None, _) => None,
                (Some(v), None) => Some(String::from_utf8_lossy(v.as_bytes()).into_owned()),
                (Some(_), Some(_)) => return problem(400, "idempotency_key_invalid", false),
            }
        }
        KeyIn::Body => match fingerprint
            .as_object_mut()
            .and_then(|o| o.remove("idempotencyKey"))
        {
            None => None,
            Some(Value::String(k)) => Some(k),
            Some(_) => return problem(400, "idempotency_key_invalid", false),
        },
    };
    let (Some(sku), Some(quantity)) = (
        fingerprint.get("sku").and_then(Value::as_str).map(str::to_owned),
        fingerprint.get("quantity").and_then(Value::as_i64),
    ) else {
        return problem(400, "validation_failed", false);
    };
    if sku.is_empty() || quantity < 1 {
        return problem(400, "validation_failed", false);
    }
    let key = match key {
        Some(k) if valid_key(&k) || design == Design::LaxKeys => k,
        None if design == Design::LaxKeys => {
            // No key: processed with no idempotency at all.
            return work(app, &account, &sku, quantity)
                .await
                .into_response(None, false);
        }
        Some(_) => return problem(400, "idempotency_key_invalid", false),
        None => return problem(400, "idempotency_key_missing", false),
    };
    let scope = if design == Design::Unscoped {
        key
    } else {
        format!("{account}\u{0}{key}")
    };
    let replay_status = (key_in == KeyIn::Body).then_some(StatusCode::OK);

    match design {
        Design::NeverApplied => {
            // Acknowledged, and nothing is stored or applied.
            let id = app.next_id.fetch_add(1, Ordering::SeqCst);
            return Stored::order(id, &sku, quantity).into_response(None, false);
        }
        Design::Instant => {
            let mut records = app.records.lock().unwrap();
            if let Some(existing) = records.get(&scope) {
                return existing_answer(design, existing, &fingerprint, replay_status);
            }
            let response = apply(app, &account, &sku, quantity);
            records.insert(
                scope,
                Record::Done {
                    fingerprint,
                    response: response.clone(),
                },
            );
            return response.into_response(None, false);
        }
        Design::Toctou => {
            let existing = app.records.lock().unwrap().get(&scope).cloned();
            if let Some(existing) = existing {
                return existing_answer(design, &existing, &fingerprint, replay_status);
            }
            tokio::time::sleep(GAP).await;
            app.records.lock().unwrap().insert(
                scope.clone(),
                Record::InFlight {
                    fingerprint: fingerprint.clone(),
                },
            );
        }
        _ => loop {
            let existing = {
                let mut records = app.records.lock().unwrap();
                let existing = records.get(&scope).cloned();
                if existing.is_none() {
                    records.insert(
                        scope.clone(),
                        Record::InFlight {
                            fingerprint: fingerprint.clone(),
                        },
                    );
                }
                existing
            };
            match existing {
                None => break,
                Some(Record::InFlight { fingerprint: f })
                    if design == Design::Waiting && f == fingerprint =>
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Some(existing) => return existing_answer(design, &existing, &fingerprint, replay_status),
            }
        },
    }
    let response = work(app, &account, &sku, quantity).await;
    app.records.lock().unwrap().insert(
        scope,
        Record::Done {
            fingerprint,
            response: response.clone(),
        },
    );
    response.into_response(None, false)
}

async fn work(app: &App, account: &str, sku: &str, quantity: i64) -> Stored {
    let took = if app.design == Design::Waiting {
        SLOW_WORK
    } else {
        WORK
    };
    tokio::time::sleep(took).await;
    apply(app, account, sku, quantity)
}

/// The side effect: one order for the account.
fn apply(app: &App, account: &str, sku: &str, quantity: i64) -> Stored {
    *app.counts.lock().unwrap().entry(account.to_owned()).or_default() += 1;
    let id = app.next_id.fetch_add(1, Ordering::SeqCst);
    Stored::order(id, sku, quantity)
}

fn existing_answer(
    design: Design,
    record: &Record,
    fingerprint: &Value,
    replay_status: Option<StatusCode>,
) -> Response {
    let fingerprinted = design != Design::NoFingerprint;
    match record {
        Record::InFlight { .. } if design == Design::Binary => {
            // Seen is seen: there is no "still running" to say.
            problem(409, "idempotency_key_reused", false)
        }
        Record::InFlight { fingerprint: f } | Record::Done { fingerprint: f, .. }
            if fingerprinted && f != fingerprint =>
        {
            problem(409, "idempotency_key_reused", false)
        }
        Record::InFlight { .. } => problem(409, "idempotency_request_in_progress", true),
        Record::Done { response, .. } => {
            let mut res = response.clone().into_response(replay_status, true);
            if design == Design::LossyReplay {
                // Only the body was kept: the Location is gone, the content type a guess.
                res.headers_mut().remove(header::LOCATION);
                res.headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            }
            res
        }
    }
}

impl Stored {
    fn order(id: i64, sku: &str, quantity: i64) -> Self {
        Self {
            status: StatusCode::CREATED,
            body: json!({ "id": id, "sku": sku, "quantity": quantity })
                .to_string()
                .into_bytes(),
            location: format!("/orders/{id}"),
        }
    }

    fn into_response(self, replay_status: Option<StatusCode>, replayed: bool) -> Response {
        let mut res = (replay_status.unwrap_or(self.status), self.body).into_response();
        let h = res.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(header::LOCATION, HeaderValue::from_str(&self.location).unwrap());
        if replayed {
            h.insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        res
    }
}
