//! The leanest proxy that keeps the guarantee on Redis keys, the floor the
//! `redis/pg-up` row is measured beside (the bench's own executable run as
//! `--lean-proxy UPSTREAM REDIS_URL PREFIX`, a process of its own as `idemkit proxy`
//! is).
//!
//! Per keyed request it does only what the contract cannot drop: the body
//! read whole and fingerprinted (SHA-256 of method, path and body); the intent
//! written before anything is forwarded (one `SET … NX PX`, so a duplicate
//! finds it); the request forwarded on a pooled connection; the answer stored
//! before it is returned (one `SET`); a duplicate replayed (or refused `409`
//! while in flight, `422` on another payload). What it leaves out is what
//! `idemkit proxy` adds on top: fencing tokens and leases with heartbeats,
//! takeover and parking of unknown outcomes, hop-by-hop and forwarding
//! headers, the stored header allowlist, path normalisation, body budgets,
//! timeouts, compression, metrics and tracing.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sha2::{Digest, Sha256};

struct Lean {
    upstream: String,
    client: Client<HttpConnector, Full<Bytes>>,
    redis: redis::aio::MultiplexedConnection,
    /// The prefix of every key it writes.
    prefix: String,
}

fn answer(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(body.into()));
    *res.status_mut() = status;
    res
}

/// A stored answer: `c` + the 64 hex digits of the fingerprint + the status
/// (3 digits) + the body; an intent: `i` + the fingerprint.
async fn handle(lean: Arc<Lean>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let Ok(body) = body.collect().await.map(|c| c.to_bytes()) else {
        return Ok(answer(StatusCode::BAD_REQUEST, "unreadable body"));
    };
    let (Some(account), Some(key)) = (
        parts.headers.get(http::header::AUTHORIZATION),
        parts.headers.get("idempotency-key"),
    ) else {
        return Ok(answer(StatusCode::BAD_REQUEST, "credential and key required"));
    };
    let scope = format!(
        "{}:{}:{}",
        lean.prefix,
        hex::encode(Sha256::digest(account.as_bytes())),
        String::from_utf8_lossy(key.as_bytes())
    );
    let fp = hex::encode(
        Sha256::new()
            .chain_update(parts.method.as_str())
            .chain_update([0])
            .chain_update(parts.uri.path())
            .chain_update([0])
            .chain_update(&body)
            .finalize(),
    );
    let mut redis = lean.redis.clone();
    let claimed: Option<String> = match redis::cmd("SET")
        .arg(&scope)
        .arg(format!("i{fp}"))
        .arg("NX")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut redis)
        .await
    {
        Ok(v) => v,
        Err(_) => return Ok(answer(StatusCode::SERVICE_UNAVAILABLE, "store unavailable")),
    };
    if claimed.is_none() {
        let held: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&scope)
            .query_async(&mut redis)
            .await
            .unwrap_or(None);
        return Ok(match held {
            Some(v) if v.len() >= 65 && v[1..65] != *fp.as_bytes() => answer(
                StatusCode::UNPROCESSABLE_ENTITY,
                "key reused with another payload",
            ),
            Some(v) if v.first() == Some(&b'c') && v.len() >= 68 => {
                let status = std::str::from_utf8(&v[65..68])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .and_then(|s| StatusCode::from_u16(s).ok())
                    .unwrap_or(StatusCode::OK);
                answer(status, v[68..].to_vec())
            }
            _ => answer(StatusCode::CONFLICT, "in progress"),
        });
    }
    let mut forward =
        Request::builder()
            .method(parts.method)
            .uri(format!("{}{}", lean.upstream, parts.uri.path()));
    for (name, value) in &parts.headers {
        if name != http::header::HOST {
            forward = forward.header(name, value);
        }
    }
    let forward = forward.body(Full::new(body)).expect("a valid request");
    let Ok(res) = lean.client.request(forward).await else {
        // Unknown outcome: the intent stays, a duplicate is refused.
        return Ok(answer(StatusCode::BAD_GATEWAY, "upstream failed"));
    };
    let (head, body) = res.into_parts();
    let Ok(body) = body.collect().await.map(|c| c.to_bytes()) else {
        return Ok(answer(StatusCode::BAD_GATEWAY, "upstream body failed"));
    };
    let mut stored = Vec::with_capacity(68 + body.len());
    stored.push(b'c');
    stored.extend_from_slice(fp.as_bytes());
    stored.extend_from_slice(head.status.as_str().as_bytes());
    stored.extend_from_slice(&body);
    let done: redis::RedisResult<()> = redis::cmd("SET")
        .arg(&scope)
        .arg(stored)
        .arg("PX")
        .arg(86_400_000)
        .query_async(&mut redis)
        .await;
    if done.is_err() {
        return Ok(answer(StatusCode::SERVICE_UNAVAILABLE, "store unavailable"));
    }
    Ok(Response::from_parts(head, Full::new(body)))
}

/// Runs the lean proxy in front of `upstream` on `redis_url`, its keys under
/// `prefix`; prints `lean
/// proxy listening on http://ADDR` once it accepts connections.
pub(crate) async fn run(upstream: String, redis_url: String, prefix: String) {
    let redis = redis::Client::open(redis_url)
        .expect("a Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis is reachable");
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let lean = Arc::new(Lean {
        upstream,
        client: Client::builder(TokioExecutor::new()).build(connector),
        redis,
        prefix,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!(
        "lean proxy listening on http://{}",
        listener.local_addr().unwrap()
    );
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let lean = lean.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(lean.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}
