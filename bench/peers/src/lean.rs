//! The leanest in-memory idempotency layer that keeps the memory path's
//! guarantee within one process, as the floor the `idemkit lease, MemoryStore`
//! setup is measured against (issue 36, target 2): one `Mutex<HashMap>` keyed
//! by (account, key), a SHA-256 of method, path and body bytes as the
//! fingerprint, the claim and the decision under the lock, the handler run
//! outside it, its whole answer (status, headers, bytes) stored and replayed,
//! a server error freeing the key.
//!
//! What it leaves out, so that its ratio is an upper bound on what any design
//! of the same guarantee reaches here: no lease, heartbeat or fencing (one
//! process, nothing to take over), no JSON canonicalisation (byte-identical
//! bodies only), no problem documents (bare status codes), no key validation
//! beyond presence, no metrics, no tracing, no detaching of a request whose
//! caller hung up, no replay window and no reaper.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

enum Slot {
    InFlight,
    Done {
        fingerprint: [u8; 32],
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
}

/// The records: (account, key) → slot.
#[derive(Default)]
pub(crate) struct LeanStore(Mutex<HashMap<(String, String), Slot>>);

/// The middleware (`axum::middleware::from_fn_with_state`).
pub(crate) async fn lean_layer(State(store): State<Arc<LeanStore>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let Some(key) = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty() && k.len() <= 255)
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Some(account) = idemkit_tower::bearer_token(&parts) else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    let scope = (account.to_owned(), key.to_owned());
    let Ok(bytes) = to_bytes(body, 1 << 20).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let mut hash = Sha256::new();
    hash.update(parts.method.as_str());
    hash.update([0]);
    hash.update(parts.uri.path());
    hash.update([0]);
    hash.update(&bytes);
    let fingerprint: [u8; 32] = hash.finalize().into();

    match store.0.lock().unwrap().entry(scope.clone()) {
        Entry::Vacant(v) => {
            v.insert(Slot::InFlight);
        }
        Entry::Occupied(o) => {
            return match o.get() {
                Slot::Done {
                    fingerprint: f,
                    status,
                    headers,
                    body,
                } if *f == fingerprint => {
                    let mut res = Response::new(Body::from(body.clone()));
                    *res.status_mut() = *status;
                    *res.headers_mut() = headers.clone();
                    res.headers_mut()
                        .insert("idempotent-replayed", HeaderValue::from_static("true"));
                    res
                }
                Slot::Done { .. } => StatusCode::UNPROCESSABLE_ENTITY.into_response(),
                Slot::InFlight => StatusCode::CONFLICT.into_response(),
            };
        }
    }

    let res = next.run(Request::from_parts(parts, Body::from(bytes))).await;
    let (head, body) = res.into_parts();
    let body = match to_bytes(body, 1 << 20).await {
        Ok(b) => b,
        Err(_) => {
            store.0.lock().unwrap().remove(&scope);
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
    };
    {
        let mut map = store.0.lock().unwrap();
        if head.status.is_server_error() {
            map.remove(&scope);
        } else {
            map.insert(
                scope,
                Slot::Done {
                    fingerprint,
                    status: head.status,
                    headers: head.headers.clone(),
                    body: body.clone(),
                },
            );
        }
    }
    Response::from_parts(head, Body::from(body))
}
