//! # idemkit-check
//!
//! Black-box conformance gates for any idempotent HTTP API, callable from your own
//! `cargo test` against an in-process service ([`ServiceTransport`], feature `tower`)
//! or a running one ([`HttpTransport`], feature `reqwest`).
//!
//! The gates turn the contract's measurements (and the key, fingerprint, scope and
//! replay rules they rest on) into checks a team points at its own API: they send real requests built from a
//! [`Template`] through a [`Transport`], read the answers and, when a side-effect
//! probe is configured, count the effects. Each gate yields a [`Verdict`] with
//! evidence; a gate that cannot judge says [`Verdict::Inconclusive`], never `Pass`.
//!
//! | # | gate | passing shows |
//! |---|---|---|
//! | 1 | [`Gate::Concurrency`] | N identical requests with one fresh key at once → one effect; every other answer is an identical replay or a conflict |
//! | 2 | [`Gate::Replay`] | a retry replays status (or the declared replay status), body bytes and allowlisted headers, marked, with no new effect |
//! | 3 | [`Gate::Mismatch`] | same key, different body → a 4xx conflict, not a replay, no effect, code unlike the in-progress one |
//! | 4 | [`Gate::InProgress`] | overlapping duplicates get the in-progress conflict (distinct code, `Retry-After`) or the identical replay; no overlap provoked → inconclusive |
//! | 5 | [`Gate::BadKeys`] | missing, empty, 256-character, control-character keys → 4xx, no effect |
//! | 6 | [`Gate::Isolation`] | the same key from another account → its own effect, never the first account's response |
//! | 7 | [`Gate::FreshKey`] | a fresh key → a new effect; reordered JSON members under a used key → replay, not mismatch |
//! | 8 | [`Gate::ClaimedIdempotent`] | the same request twice without a key → the second leaves the state (`--state-url` JSON or count) as the first left it |
//! | 9 | [`Gate::Policy`] | the endpoint does what its published `x-idempotency` says: key location, replay status and marker, conflict statuses and codes |
//!
//! Over gRPC ([`GrpcTransport`], feature `grpc`) the same gates run against one
//! unary method; the policy gate does not apply there ([`Verdict::NotApplicable`]).
//!
//! What the gates establish is *effectively once within the key scope and replay
//! window* as far as a black box can see it: they cannot see inside a server, cannot
//! crash it between phases, and see effects only through the probe they are given.
//!
//! The `idemkit check` command is a thin shell around [`run`] with the reqwest
//! transport; tests can drive the same gates through any [`Transport`].
//!
//! ```
//! use idemkit_check::{Answer, CheckConfig, Request, Template, Transport, TransportError, Verdict};
//!
//! /// A transport to a server that is not there.
//! struct Nowhere;
//!
//! #[async_trait::async_trait]
//! impl Transport for Nowhere {
//!     async fn send(&self, _: Request) -> Result<Answer, TransportError> {
//!         Err(TransportError("connection refused".into()))
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let template = Template::new(http::Method::POST, "http://127.0.0.1:3000/orders")
//!     .with_body(br#"{"sku":"BOOK-1","quantity":1}"#)
//!     .unwrap();
//! let config = CheckConfig::new(template).with_count_url("http://127.0.0.1:3000/orders/count");
//! let report = idemkit_check::run(&config, &Nowhere, &()).await;
//! // Nothing answered, so nothing was judged: inconclusive, never a pass.
//! assert!(report.gates.iter().all(|g| g.verdict == Verdict::Inconclusive));
//! assert_eq!(report.exit_code(), 2);
//! # }
//! ```

//!
//! ## Crate features
//!
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bad_keys;
mod claimed;
mod concurrency;
mod config;
#[cfg(test)]
mod fake;
mod fresh_key;
mod in_progress;
mod isolation;
mod mismatch;
mod policy;
mod replay;
mod report;
mod template;
mod transport;

#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
mod grpc_transport;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
mod http_transport;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
mod service_transport;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use http::{HeaderName, HeaderValue, Method};

pub use config::CheckConfig;
pub use policy::{Expected, Published};
pub use report::{Gate, GateReport, Report, UnknownGate, Verdict};
pub use template::{KeyPlacement, Template, TemplateError};
pub use transport::{Answer, Request, Transport, TransportError};

#[cfg(feature = "grpc")]
pub use grpc_transport::{
    GrpcTransport, http_status as grpc_http_status, request_message as grpc_request_message,
};
#[cfg(feature = "reqwest")]
pub use http_transport::HttpTransport;
#[cfg(feature = "tower")]
pub use service_transport::ServiceTransport;

use template::Variant;

/// How many requests the concurrency and in-progress gates start at once by default.
pub const DEFAULT_CONCURRENCY: usize = 50;

/// The longest key the contract allows is 255 characters; the gates send one more.
pub const OVERSIZED_KEY_LEN: usize = 256;

/// Hears what a check is doing, for progress bars. Every method defaults to nothing.
pub trait Progress: Send + Sync {
    /// A gate starts.
    fn gate_started(&self, gate: Gate) {
        let _ = gate;
    }
    /// The running gate is about to send `n` more requests.
    fn planned(&self, n: usize) {
        let _ = n;
    }
    /// One request of the running gate got its answer (or gave up).
    fn request_done(&self) {}
    /// A gate has its verdict.
    fn gate_finished(&self, report: &GateReport) {
        let _ = report;
    }
}

impl Progress for () {}

/// Runs the configured gates one after another and reports on each.
pub async fn run(config: &CheckConfig, transport: &dyn Transport, progress: &dyn Progress) -> Report {
    let ctx = Ctx {
        cfg: config,
        transport,
        progress,
        sent: AtomicUsize::new(0),
        observed: Mutex::new(Observed::default()),
    };
    let mut gates = Vec::new();
    for &gate in &config.gates {
        progress.gate_started(gate);
        ctx.sent.store(0, Ordering::Relaxed);
        if let Some(why) = transport.not_applicable(gate) {
            let report = GateReport {
                gate,
                number: gate.number(),
                verdict: Verdict::NotApplicable,
                evidence: why,
                details: Vec::new(),
                requests: 0,
            };
            progress.gate_finished(&report);
            gates.push(report);
            continue;
        }
        let judged = match gate {
            Gate::Concurrency => concurrency::run(&ctx).await,
            Gate::Replay => replay::run(&ctx).await,
            Gate::Mismatch => mismatch::run(&ctx).await,
            Gate::InProgress => in_progress::run(&ctx).await,
            Gate::BadKeys => bad_keys::run(&ctx).await,
            Gate::Isolation => isolation::run(&ctx).await,
            Gate::FreshKey => fresh_key::run(&ctx).await,
            Gate::ClaimedIdempotent => claimed::run(&ctx).await,
            Gate::Policy => policy::run(&ctx).await,
        };
        let judgement = judged.unwrap_or_else(|Unjudged(reason)| Judgement {
            verdict: Verdict::Inconclusive,
            evidence: reason,
            details: Vec::new(),
        });
        let report = GateReport {
            gate,
            number: gate.number(),
            verdict: judgement.verdict,
            evidence: judgement.evidence,
            details: judgement.details,
            requests: ctx.sent.load(Ordering::Relaxed),
        };
        progress.gate_finished(&report);
        gates.push(report);
    }
    Report { gates }
}

/// A gate that could not judge, and why.
struct Unjudged(String);

struct Judgement {
    verdict: Verdict,
    evidence: String,
    details: Vec<String>,
}

/// What a gate found, turned into a verdict by [`Findings::finish`]: any failure
/// fails; otherwise any unjudged part makes it inconclusive; otherwise it passes.
#[derive(Default)]
struct Findings {
    failures: Vec<String>,
    unjudged: Vec<String>,
    details: Vec<String>,
}

impl Findings {
    fn fail(&mut self, why: impl Into<String>) {
        self.failures.push(why.into());
    }

    fn unjudged(&mut self, why: impl Into<String>) {
        self.unjudged.push(why.into());
    }

    fn note(&mut self, note: impl Into<String>) {
        self.details.push(note.into());
    }

    fn finish(self, observed: impl Into<String>) -> Result<Judgement, Unjudged> {
        let observed = observed.into();
        let (verdict, evidence) = if !self.failures.is_empty() {
            (
                Verdict::Fail,
                format!("{}. Observed: {observed}", self.failures.join("; ")),
            )
        } else if !self.unjudged.is_empty() {
            (
                Verdict::Inconclusive,
                format!("{}. Observed: {observed}", self.unjudged.join("; ")),
            )
        } else {
            (Verdict::Pass, observed)
        };
        Ok(Judgement {
            verdict,
            evidence,
            details: self.details,
        })
    }
}

/// A conflict's identity: its status and machine code.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signal {
    status: u16,
    code: Option<String>,
}

impl Signal {
    fn of(answer: &Answer) -> Self {
        Self {
            status: answer.status,
            code: code_of(answer),
        }
    }

    /// Whether a client can tell the two apart (by status or by code).
    fn distinct_from(&self, other: &Signal) -> bool {
        self.status != other.status || self.code != other.code
    }
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.code {
            Some(code) => write!(f, "{} {code}", self.status),
            None => write!(f, "{} (no code)", self.status),
        }
    }
}

/// The machine code of an error body: problem+json `code`, a nested `error.code`,
/// `type`, `error.type`, or a bare `error` string.
fn code_of(answer: &Answer) -> Option<String> {
    let v = answer.json()?;
    let text = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_owned);
    text(v.get("code"))
        .or_else(|| text(v.pointer("/error/code")))
        .or_else(|| text(v.get("type")))
        .or_else(|| text(v.pointer("/error/type")))
        .or_else(|| text(v.get("error")))
}

/// The statuses a duplicate may be refused with while the first request runs.
fn is_conflict(answer: &Answer) -> bool {
    matches!(answer.status, 409 | 425 | 429)
}

/// An answer with when its request was started and when the answer was complete.
struct Timed {
    answer: Answer,
    sent: Instant,
    received: Instant,
}

#[derive(Default)]
struct Observed {
    /// Conflicts identical duplicates got (in-progress candidates).
    in_progress: Vec<Signal>,
    /// The conflict a different body under a used key got.
    mismatch: Option<Signal>,
}

/// Which account a request or probe read speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Account {
    Main,
    Other,
}

struct Ctx<'a> {
    cfg: &'a CheckConfig,
    transport: &'a dyn Transport,
    progress: &'a dyn Progress,
    sent: AtomicUsize,
    observed: Mutex<Observed>,
}

impl Ctx<'_> {
    fn fresh_key(&self, gate: &str) -> String {
        if self.cfg.uuid_keys {
            // AIP-155 request ids: a bare UUID4, nothing else.
            return uuid::Uuid::new_v4().to_string();
        }
        format!("idemkit-check-{gate}-{}", uuid::Uuid::new_v4())
    }

    fn replace(&self, account: Account) -> Option<&(HeaderName, HeaderValue)> {
        match account {
            Account::Main => None,
            Account::Other => self.cfg.other_account.as_ref(),
        }
    }

    fn request(&self, key: Option<&str>, variant: Variant, account: Account) -> Request {
        self.cfg.template.request(key, variant, self.replace(account))
    }

    async fn send(&self, request: Request) -> Result<Answer, Unjudged> {
        self.progress.planned(1);
        self.sent.fetch_add(1, Ordering::Relaxed);
        let answer = self.transport.send(request).await;
        self.progress.request_done();
        answer.map_err(|e| Unjudged(format!("a request got no answer: {e}")))
    }

    /// Starts `n` copies of `request` together and waits for every answer.
    async fn burst(&self, request: &Request, n: usize) -> Result<Vec<Answer>, Unjudged> {
        Ok(self
            .timed_burst(request, n)
            .await?
            .into_iter()
            .map(|t| t.answer)
            .collect())
    }

    /// [`Ctx::burst`], with when each request was started and answered.
    async fn timed_burst(&self, request: &Request, n: usize) -> Result<Vec<Timed>, Unjudged> {
        self.progress.planned(n);
        self.sent.fetch_add(n, Ordering::Relaxed);
        let results = futures::future::join_all((0..n).map(|_| async {
            let sent = Instant::now();
            let answer = self.transport.send(request.clone()).await;
            self.progress.request_done();
            answer.map(|answer| Timed {
                answer,
                sent,
                received: Instant::now(),
            })
        }))
        .await;
        let failed: Vec<&TransportError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        if let Some(first) = failed.first() {
            return Err(Unjudged(format!(
                "{} of {n} simultaneous requests got no answer (first error: {first})",
                failed.len()
            )));
        }
        Ok(results.into_iter().filter_map(Result::ok).collect())
    }

    /// The account's effect count from the probe, `None` without a count probe.
    async fn count(&self, account: Account) -> Result<Option<i64>, Unjudged> {
        let Some(url) = &self.cfg.count_url else {
            return Ok(None);
        };
        let answer = self
            .send(self.probe_request(url, account))
            .await
            .map_err(|Unjudged(e)| Unjudged(format!("the count probe failed: {e}")))?;
        parse_count(&answer, self.cfg.count_pointer.as_deref())
            .map(Some)
            .ok_or_else(|| {
                Unjudged(format!(
                    "the count probe {url} answered {} `{}`, not a count ({})",
                    answer.status,
                    excerpt(&answer.body),
                    match &self.cfg.count_pointer {
                        Some(p) => format!("no integer at {p}"),
                        None => "`{\"count\": n}` or a bare number".to_owned(),
                    }
                ))
            })
    }

    /// A probe read: `GET url` with the template's headers (or the other account's).
    fn probe_request(&self, url: &str, account: Account) -> Request {
        let mut headers = self.cfg.template.headers().clone();
        if let Some((name, value)) = self.replace(account) {
            headers.insert(name.clone(), value.clone());
        }
        Request {
            method: Method::GET,
            url: url.to_owned(),
            headers,
            body: Vec::new(),
        }
    }

    fn has_count(&self) -> bool {
        self.cfg.count_url.is_some()
    }

    fn has_ids(&self) -> bool {
        self.cfg.id_pointer.is_some()
    }

    /// The resource id the answer shows, with an id probe.
    fn id_of(&self, answer: &Answer) -> Option<String> {
        let pointer = self.cfg.id_pointer.as_ref()?;
        answer.json()?.pointer(pointer).map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }

    fn marked(&self, answer: &Answer) -> bool {
        let (name, value) = &self.cfg.replay_marker;
        answer
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case(value))
    }

    fn marker(&self) -> String {
        let (name, value) = &self.cfg.replay_marker;
        format!("{}: {value}", header_title(name))
    }

    /// The status a replay of `original` must carry.
    fn replay_status(&self, original: &Answer) -> u16 {
        self.cfg.replay_status.unwrap_or(original.status)
    }

    /// Same body bytes as `original`, and its status or the declared replay status.
    fn same_as(&self, answer: &Answer, original: &Answer) -> bool {
        answer.body == original.body
            && (answer.status == original.status || answer.status == self.replay_status(original))
    }

    /// A short label: status, code, replay marker, `Retry-After`.
    fn label(&self, answer: &Answer) -> String {
        let mut s = answer.status.to_string();
        if !answer.is_success()
            && let Some(code) = code_of(answer)
        {
            s.push(' ');
            s.push_str(&code);
        }
        if answer.is_success() {
            s.push_str(if self.marked(answer) {
                " replay"
            } else {
                " original"
            });
        }
        if let Some(ra) = answer.header("retry-after") {
            s.push_str(&format!(" (Retry-After {ra})"));
        }
        s
    }

    /// The label plus the id and a body excerpt, for evidence.
    fn describe(&self, answer: &Answer) -> String {
        let mut s = self.label(answer);
        if let Some(id) = self.id_of(answer) {
            s.push_str(&format!(" id {id}"));
        }
        s.push_str(&format!(" `{}`", excerpt(&answer.body)));
        s
    }

    /// "3 × 201 replay, 46 × 409 idempotency_request_in_progress (Retry-After 1)".
    fn histogram<'b>(&self, answers: impl IntoIterator<Item = &'b Answer>) -> String {
        let mut counts: BTreeMap<(u16, String), usize> = BTreeMap::new();
        for a in answers {
            *counts.entry((a.status, self.label(a))).or_default() += 1;
        }
        counts
            .into_iter()
            .map(|((_, label), n)| format!("{n} × {label}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn record_in_progress(&self, signal: Signal) {
        let mut observed = self.observed.lock().expect("observations");
        if !observed.in_progress.contains(&signal) {
            observed.in_progress.push(signal);
        }
    }

    fn in_progress_signals(&self) -> Vec<Signal> {
        self.observed.lock().expect("observations").in_progress.clone()
    }

    fn record_mismatch(&self, signal: Signal) {
        self.observed.lock().expect("observations").mismatch = Some(signal);
    }

    fn mismatch_signal(&self) -> Option<Signal> {
        self.observed.lock().expect("observations").mismatch.clone()
    }
}

/// `{"count": n}`, a bare JSON number, or a number as text; with a pointer, the
/// integer at that pointer.
fn parse_count(answer: &Answer, pointer: Option<&str>) -> Option<i64> {
    if !answer.is_success() {
        return None;
    }
    if let Some(pointer) = pointer {
        return answer.json()?.pointer(pointer)?.as_i64();
    }
    match answer.json() {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(v) => v.get("count").and_then(serde_json::Value::as_i64),
        None => std::str::from_utf8(&answer.body).ok()?.trim().parse().ok(),
    }
}

/// The body as text, cut to 120 characters.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    let mut out: String = text.chars().take(120).collect();
    if text.chars().count() > 120 {
        out.push('…');
    }
    out.replace('\n', " ")
}

/// `idempotent-replayed` → `Idempotent-Replayed`, for messages.
fn header_title(name: &HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|part| {
            let mut chars = part.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join("-")
}

/// "count 4 → 5" or "not counted".
fn count_change(before: Option<i64>, after: Option<i64>) -> String {
    match (before, after) {
        (Some(b), Some(a)) => format!("count {b} → {a}"),
        _ => "effects not counted".to_owned(),
    }
}

/// Why a gate that must count effects cannot judge without a count probe. Ids
/// (`--id-pointer`) tell apart the effects whose answers show them; an effect behind a
/// replay, a conflict or a refusal shows no id, so ids alone never make a pass.
const NO_PROBE: &str = "no count probe was given (pass --count-url; --id-pointer alone cannot see an effect behind a replay, a conflict or a refusal)";

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: &str) -> Answer {
        Answer {
            status,
            headers: http::HeaderMap::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn codes_come_from_common_error_shapes() {
        assert_eq!(
            code_of(&answer(409, r#"{"code":"a","type":"t"}"#)).as_deref(),
            Some("a")
        );
        assert_eq!(
            code_of(&answer(409, r#"{"error":{"code":"b"}}"#)).as_deref(),
            Some("b")
        );
        assert_eq!(code_of(&answer(409, r#"{"error":"c"}"#)).as_deref(), Some("c"));
        assert_eq!(code_of(&answer(409, "nope")), None);
    }

    #[test]
    fn counts_parse_from_object_number_or_text() {
        assert_eq!(parse_count(&answer(200, r#"{"count":3}"#), None), Some(3));
        assert_eq!(parse_count(&answer(200, "7"), None), Some(7));
        assert_eq!(parse_count(&answer(200, " 8\n"), None), Some(8));
        assert_eq!(parse_count(&answer(401, r#"{"count":3}"#), None), None);
        assert_eq!(parse_count(&answer(200, r#"{"n":3}"#), None), None);
        assert_eq!(
            parse_count(&answer(200, r#"{"n":{"m":4}}"#), Some("/n/m")),
            Some(4)
        );
        assert_eq!(parse_count(&answer(200, r#"{"count":3}"#), Some("/n")), None);
    }

    #[test]
    fn signals_differ_by_status_or_code() {
        let s = |status, code: Option<&str>| Signal {
            status,
            code: code.map(str::to_owned),
        };
        assert!(s(409, Some("a")).distinct_from(&s(409, Some("b"))));
        assert!(s(409, None).distinct_from(&s(422, None)));
        assert!(!s(409, None).distinct_from(&s(409, None)));
        assert!(!s(409, Some("a")).distinct_from(&s(409, Some("a"))));
    }

    #[test]
    fn gates_parse_by_name_or_number() {
        assert_eq!("4".parse::<Gate>().unwrap(), Gate::InProgress);
        assert_eq!("in_progress".parse::<Gate>().unwrap(), Gate::InProgress);
        assert_eq!("Fresh-Key".parse::<Gate>().unwrap(), Gate::FreshKey);
        assert_eq!("8".parse::<Gate>().unwrap(), Gate::ClaimedIdempotent);
        assert_eq!(
            "claimed_idempotent".parse::<Gate>().unwrap(),
            Gate::ClaimedIdempotent
        );
        assert_eq!("policy".parse::<Gate>().unwrap(), Gate::Policy);
        assert!("10".parse::<Gate>().is_err());
        assert_eq!(
            header_title(&HeaderName::from_static("idempotent-replayed")),
            "Idempotent-Replayed"
        );
    }
}
