//! The checker: safety over the answers, the store's event log and the
//! downstreams' effects; liveness over the records once faults stopped.
//!
//! The rules of the retired race suite's history checker are here, over the
//! shipped code's history: at most one effect per request at a downstream that ignores keys
//! (and one downstream key per request at one that honours them); one answer
//! per key (every 2xx answer byte-identical and the stored one); no completed
//! record completed again; no write of a holder whose lease was taken over
//! lands; and every request that reached a downstream is completed, resumable
//! or parked / listed for review.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use idemkit_core::{KeyStore, RecordState};

use crate::store::Event;
use crate::world::{Effects, Spec};

/// The kind of a violation (negative controls assert on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// A downstream acted twice for one request.
    DuplicateEffect,
    /// An answer that is neither the stored one nor a documented refusal.
    WrongAnswer,
    /// A completed record was completed again.
    Reopened,
    /// A write of a holder whose lease was taken over landed.
    StaleWrite,
    /// A claim took a key whose holder's lease had not run out.
    StolenLease,
    /// An acknowledged answer is not what the store keeps.
    Lost,
    /// A key never settles, or a request answers "in progress" forever.
    Stuck,
}

/// One violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Its kind.
    pub kind: Kind,
    /// What was seen.
    pub detail: String,
}

impl Violation {
    fn new(kind: Kind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
        }
    }

    /// A liveness violation.
    pub fn stuck(detail: impl Into<String>) -> Self {
        Self::new(Kind::Stuck, detail)
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.detail)
    }
}

/// An answer a client saw.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Which request ([`Spec::id`]).
    pub spec: usize,
    /// Status (0: the client hung up first).
    pub status: u16,
    /// The problem `code`, when the body is a problem document.
    pub code: Option<String>,
    /// Body bytes.
    pub body: Vec<u8>,
    /// Sent after faults stopped and the completer ran.
    pub final_check: bool,
    /// What the body shows the checker when it is not JSON itself (a gRPC
    /// reply's frames: the JSON its message carries).
    pub view: Option<Vec<u8>>,
}

impl Answer {
    /// An answer.
    pub fn new(spec: usize, status: u16, body: Vec<u8>, final_check: bool) -> Self {
        let code = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
        Self {
            spec,
            status,
            code,
            body,
            final_check,
            view: None,
        }
    }

    /// A gRPC answer: its status in HTTP terms, its problem code, the bytes
    /// the layer stores (frames), and their JSON view.
    pub fn grpc(
        spec: usize,
        status: u16,
        code: Option<String>,
        body: Vec<u8>,
        view: Option<Vec<u8>>,
        final_check: bool,
    ) -> Self {
        Self {
            spec,
            status,
            code,
            body,
            final_check,
            view,
        }
    }

    /// The client gave up waiting.
    pub fn hung_up(spec: usize, final_check: bool) -> Self {
        Self {
            spec,
            status: 0,
            code: None,
            body: Vec::new(),
            final_check,
            view: None,
        }
    }

    fn success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The request marker its body echoes: an answer a handler or the
    /// upstream produced, which becomes the key's answer once stored (a
    /// refusal of a layer, the proxy or the engine echoes none).
    fn echoed(&self) -> Option<String> {
        serde_json::from_slice::<serde_json::Value>(self.view.as_deref().unwrap_or(&self.body))
            .ok()
            .and_then(|v| v.get("item").and_then(|i| i.as_str()).map(str::to_owned))
    }

    fn is(&self, code: &str) -> bool {
        self.code.as_deref() == Some(code)
    }

    fn documented_refusal(&self) -> bool {
        match self.status {
            0 => true,
            409 | 422 => [
                "idempotency_request_in_progress",
                "idempotency_lease_lost",
                "idempotency_key_reused",
                "idempotency_request_parked",
            ]
            .iter()
            .any(|c| self.is(c)),
            // The handler's own error (a downstream failed), a panic, the store.
            500 | 502 | 503 => true,
            // The attempt's `Request-Timeout` ran out before it could be served.
            504 => self.is("deadline_exceeded"),
            _ => false,
        }
    }
}

/// Liveness: after faults stopped and the completer ran past lease and age,
/// every key is completed, released, parked, listed for review, or was never
/// claimed; none is still in flight.
pub async fn settled(store: &Arc<dyn KeyStore>, specs: &[Spec]) -> Vec<Violation> {
    let mut out = Vec::new();
    let review = store.review(1000).await.unwrap_or_default();
    let mut seen = HashSet::new();
    for spec in specs {
        let scope = spec.scope();
        if !seen.insert(scope.clone()) {
            continue;
        }
        match store.get(&scope).await {
            Ok(Some(r)) if r.state == RecordState::InFlight => {
                if !review.iter().any(|e| e.scope == scope) {
                    out.push(Violation::stuck(format!(
                        "{}/{} still in flight after the completer ran (recovery point {:?}, last error {:?})",
                        spec.account, spec.key, r.recovery_point, r.last_error
                    )));
                }
            }
            Ok(_) => {}
            Err(e) => out.push(Violation::stuck(format!("{}/{}: {e}", spec.account, spec.key))),
        }
    }
    out
}

/// The scopes whose record is unfinished (parked or in flight).
pub async fn unfinished(store: &Arc<dyn KeyStore>, specs: &[Spec]) -> Vec<idemkit_core::Scope> {
    let mut out = Vec::new();
    for s in specs {
        let scope = s.scope();
        if out.contains(&scope) {
            continue;
        }
        if let Ok(Some(r)) = store.get(&scope).await
            && matches!(r.state, RecordState::Parked | RecordState::InFlight)
        {
            out.push(scope);
        }
    }
    out
}

/// The reaper, past every record's reap threshold: a request that never
/// completed (`unfinished`: parked or in flight before the pass) is listed
/// for review and stays in the key table, parked, so its key never runs
/// again as a new request (it may have reached a downstream that ignores
/// keys); `after` are the answers to those requests sent after the pass,
/// and `fx` the downstream calls made since the safety check.
pub async fn reaped(
    store: &Arc<dyn KeyStore>,
    specs: &[Spec],
    unfinished: &[idemkit_core::Scope],
    after: &[Answer],
    fx: &Effects,
) -> Vec<Violation> {
    let mut out = Vec::new();
    let review = store.review(1000).await.unwrap_or_default();
    for scope in unfinished {
        let name = format!("{}/{}", scope.account.as_str(), scope.key.as_str());
        match store.get(scope).await {
            Ok(Some(r)) if r.state == RecordState::Parked => {}
            Ok(r) => out.push(Violation::new(
                Kind::Lost,
                format!(
                    "{name}: unfinished before the reaper's pass, now {:?}: its key can run again as a new request",
                    r.map(|r| r.state)
                ),
            )),
            Err(e) => out.push(Violation::stuck(format!("{name}: {e}"))),
        }
        if !review.iter().any(|e| &e.scope == scope) {
            out.push(Violation::new(
                Kind::Lost,
                format!("{name}: unfinished past the reap threshold and not in the review list"),
            ));
        }
    }
    for (item, calls) in fx.ignoring.iter().chain(&fx.honouring) {
        if !calls.is_empty() {
            out.push(Violation::new(
                Kind::DuplicateEffect,
                format!("request {item}: unfinished, then reaped, it ran again: {calls:?}"),
            ));
        }
    }
    for a in after {
        let spec = &specs[a.spec];
        // Its own request is answered parked; another under its key, reused.
        if !a.is("idempotency_request_parked") && !a.is("idempotency_key_reused") {
            out.push(Violation::new(
                Kind::WrongAnswer,
                format!(
                    "request {} (unfinished, then reaped) answered {} {}, not parked",
                    spec.item,
                    a.status,
                    String::from_utf8_lossy(&a.body)
                ),
            ));
        }
    }
    out
}

/// Single-step atomicity, checked once every client is done: a single-step
/// claim is committed with its business writes and its answer, or not at
/// all, so no key of a single-step route has a record in flight (the behaviour contract: a
/// single-step attempt that ends without an answer rolls back and frees the
/// key; a claim committed on its own would hold it until its lease ran out).
pub async fn single_step_free(store: &Arc<dyn KeyStore>, specs: &[Spec]) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for spec in specs.iter().filter(|s| s.single_step()) {
        let scope = spec.scope();
        if !seen.insert(scope.clone()) {
            continue;
        }
        if let Ok(Some(r)) = store.get(&scope).await
            && r.state == RecordState::InFlight
        {
            out.push(Violation::stuck(format!(
                "single-step key {}/{} is held in flight (token {}) with no transaction open: its claim committed without its answer",
                spec.account, spec.key, r.fencing_token.0
            )));
        }
    }
    out
}

/// Safety (and the final requests' liveness).
pub async fn safety(
    specs: &[Spec],
    answers: &[Answer],
    events: &[(tokio::time::Instant, Event)],
    fx: &Effects,
    rows: &[(String, i64)],
    store: &Arc<dyn KeyStore>,
) -> Vec<Violation> {
    let mut out = Vec::new();
    // Keys whose progress an operator discarded (`keys release
    // --downstream-did-nothing`), and how often. Only a truthful discard (the
    // downstreams had done nothing when the operator said so) starts a new
    // generation, whose attempt may call the downstreams once more: a false
    // one is the operator's duplicate, and the bound does not grow for it.
    let mut discards: HashMap<idemkit_core::Scope, usize> = HashMap::new();
    let mut discarded: HashSet<idemkit_core::Scope> = HashSet::new();
    let mut attested: HashMap<idemkit_core::Scope, bool> = HashMap::new();
    for (_, e) in events {
        match e {
            Event::OperatorAttested { scope, truthful } => {
                attested.insert(scope.clone(), *truthful);
            }
            Event::OperatorReleased {
                scope,
                discarded: true,
            } => {
                discarded.insert(scope.clone());
                if attested.remove(scope) == Some(true) {
                    *discards.entry(scope.clone()).or_default() += 1;
                }
            }
            _ => {}
        }
    }
    // The effects a request may have: one per generation.
    let allowed = |item: &str| {
        1 + specs
            .iter()
            .filter(|s| s.item == item)
            .map(|s| discards.get(&s.scope()).copied().unwrap_or(0))
            .max()
            .unwrap_or(0)
    };
    let spec_of = |id: usize| &specs[id];
    // Effects: one per request at the downstream that ignores keys; one key
    // per request at the one that honours them.
    for (item, calls) in &fx.ignoring {
        if calls.len() > allowed(item) {
            out.push(Violation::new(
                Kind::DuplicateEffect,
                format!(
                    "request {item}: {} calls to the downstream that ignores keys ({} generations): {calls:?}",
                    calls.len(),
                    allowed(item)
                ),
            ));
        }
    }
    for (item, keys) in &fx.honouring {
        if keys.len() > allowed(item) {
            out.push(Violation::new(
                Kind::DuplicateEffect,
                format!(
                    "request {item}: the downstream that honours keys got {} different keys: {keys:?}",
                    keys.len()
                ),
            ));
        }
    }
    for (item, n) in rows {
        if *n > 1 {
            out.push(Violation::new(
                Kind::DuplicateEffect,
                format!("request {item}: {n} business rows committed"),
            ));
        }
    }
    // Answers.
    let mut by_scope: Vec<(idemkit_core::Scope, Vec<&Answer>)> = Vec::new();
    for a in answers {
        let spec = spec_of(a.spec);
        // A success, or an error an application produced (the upstream's
        // `503` after it acted, which the proxy stores): the key's answer.
        let echoed = a.echoed();
        if a.success() || echoed.is_some() {
            if echoed.as_deref() != Some(spec.item) {
                out.push(Violation::new(
                    Kind::WrongAnswer,
                    format!(
                        "request {} got the answer of another request: {}",
                        spec.item,
                        String::from_utf8_lossy(&a.body)
                    ),
                ));
            }
            let scope = spec.scope();
            match by_scope.iter_mut().find(|(s, _)| *s == scope) {
                Some((_, list)) => list.push(a),
                None => by_scope.push((scope, vec![a])),
            }
        } else if !a.documented_refusal() {
            out.push(Violation::new(
                Kind::WrongAnswer,
                format!(
                    "request {} got an undocumented answer {} {}",
                    spec.item,
                    a.status,
                    String::from_utf8_lossy(&a.body)
                ),
            ));
        }
        // A request alone in its scope can never be a mismatch.
        let alone = specs
            .iter()
            .filter(|s| s.scope() == spec.scope())
            .all(|s| s.item == spec.item);
        if alone && a.is("idempotency_key_reused") {
            out.push(Violation::new(
                Kind::WrongAnswer,
                format!(
                    "request {} ({}/{}) answered as a mismatch, though no other request used its key in its account",
                    spec.item, spec.account, spec.key
                ),
            ));
        }
        let unavailable = a.status == 503 && echoed.is_none();
        if a.final_check && (a.is("idempotency_request_in_progress") || a.status == 0 || unavailable) {
            out.push(Violation::stuck(format!(
                "request {}: after faults stopped and the completer ran, it still answers {} {}",
                spec.item,
                a.status,
                String::from_utf8_lossy(&a.body)
            )));
        }
    }
    for (scope, list) in &by_scope {
        let first = list[0];
        if let Some(other) = list
            .iter()
            .find(|a| a.body != first.body || a.status != first.status)
            && !discarded.contains(scope)
        {
            out.push(Violation::new(
                Kind::WrongAnswer,
                format!(
                    "two different answers for {}/{}: {} {} and {} {}",
                    scope.account.as_str(),
                    scope.key.as_str(),
                    first.status,
                    String::from_utf8_lossy(&first.body),
                    other.status,
                    String::from_utf8_lossy(&other.body)
                ),
            ));
        }
        // Nothing acknowledged is lost: the store keeps what was answered.
        match store.get(scope).await {
            Ok(Some(r)) if r.state == RecordState::Completed => {
                let stored = r.response.as_ref().map(|s| s.body.clone()).unwrap_or_default();
                if stored != first.body && !discarded.contains(scope) {
                    out.push(Violation::new(
                        Kind::Lost,
                        format!(
                            "{}/{} answered {} but stores {}",
                            scope.account.as_str(),
                            scope.key.as_str(),
                            String::from_utf8_lossy(&first.body),
                            String::from_utf8_lossy(&stored)
                        ),
                    ));
                }
            }
            Ok(r) => {
                if !discarded.contains(scope) {
                    out.push(Violation::new(
                        Kind::Lost,
                        format!(
                            "{}/{} answered {} but its record is {:?}",
                            scope.account.as_str(),
                            scope.key.as_str(),
                            String::from_utf8_lossy(&first.body),
                            r.map(|r| r.state)
                        ),
                    ));
                }
            }
            Err(_) => {}
        }
    }
    // The store's history: completions and fenced writes.
    let mut completed: HashMap<_, u64> = HashMap::new();
    let mut highest: HashMap<_, i64> = HashMap::new();
    // A lease runs for a lease from the moment the store made the claim (or
    // took the heartbeat), which lies between the store call's start and its
    // answer. A takeover is a definite violation only if even the latest
    // moment it can have been made (its answer) falls before the earliest
    // moment the previous lease can end (that call's start plus the lease):
    // on a network store an answer may arrive long after the write.
    let mut holder: HashMap<_, (i64, tokio::time::Instant)> = HashMap::new();
    let tolerance = std::time::Duration::from_secs(1);
    for (at, e) in events {
        match e {
            Event::Claimed {
                scope,
                token,
                started,
            } => {
                let h = highest.entry(scope.clone()).or_insert(0);
                *h = (*h).max(token.0);
                if let Some((held, until)) = holder.get(scope)
                    && *until > *at + tolerance
                {
                    out.push(Violation::new(
                        Kind::StolenLease,
                        format!(
                            "{}/{}: token {} claimed while token {held}'s lease had {:?} left",
                            scope.account.as_str(),
                            scope.key.as_str(),
                            token.0,
                            *until - *at
                        ),
                    ));
                }
                holder.insert(scope.clone(), (token.0, *started + crate::world::LEASE));
            }
            Event::Extended {
                scope,
                token,
                started,
            } => {
                if let Some((held, until)) = holder.get_mut(scope)
                    && *held == token.0
                {
                    *until = (*until).max(*started + crate::world::LEASE);
                }
            }
            Event::Completed { scope, token, .. } | Event::FencedWrite { scope, token, .. } => {
                if let Some(h) = highest.get(scope)
                    && *h > token.0
                {
                    out.push(Violation::new(
                        Kind::StaleWrite,
                        format!(
                            "{}/{}: a write with token {} landed after token {h} was claimed ({e:?})",
                            scope.account.as_str(),
                            scope.key.as_str(),
                            token.0
                        ),
                    ));
                }
                let op = match e {
                    Event::FencedWrite { op, .. } => *op,
                    _ => "complete",
                };
                // A final write ends the holder's lease; a heartbeat's
                // extension is its own event.
                if holder.get(scope).is_some_and(|(held, _)| *held == token.0)
                    && op != "heartbeat"
                    && op != "advance"
                {
                    holder.remove(scope);
                }
                if let Event::Completed { .. } = e {
                    let n = completed.entry(scope.clone()).or_insert(0);
                    *n += 1;
                    if *n == 2 && !discarded.contains(scope) {
                        out.push(Violation::new(
                            Kind::Reopened,
                            format!(
                                "{}/{} completed twice within its replay window",
                                scope.account.as_str(),
                                scope.key.as_str()
                            ),
                        ));
                    }
                }
            }
            Event::OperatorReleased { scope, .. } => {
                holder.remove(scope);
            }
            Event::OperatorAttested { .. } => {}
        }
    }
    out
}
