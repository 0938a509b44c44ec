//! Metric names and labels the layer, the phases and the jobs emit through the
//! [`metrics`] facade.
//!
//! Nothing is recorded until the application installs a recorder (for example
//! `metrics-exporter-prometheus`); without one every call is a no-op. Call
//! [`describe`] once after installing it to attach help texts and units, and
//! [`start_at_zero`] to register every counter and gauge the alert rules read
//! at zero (a counter born at 1 shows no `increase()`, so without it the first
//! park or the first store outage would never fire an alert).
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | [`REQUESTS`] | counter | `outcome` ([`outcome`]) | requests to a guarded route, by what happened |
//! | [`IN_FLIGHT`] | gauge | | requests holding a claim in this process |
//! | [`FENCED_WRITES`] | counter | `op` | a lease holder's write refused as stale: the duplicate-side-effect alarm, expected zero |
//! | [`COMPLETER_RESUMES`] | counter | `result` | abandoned records the completer replayed |
//! | [`ORPHANED_KEYS`] | gauge | | abandoned records the last completer pass found |
//! | [`REAPER_DELETED`] | counter | | records the reaper deleted |
//! | [`REAPER_REVIEW`] | counter | | never-completed records the reaper moved to review |
//! | [`STORE_SECONDS`] | histogram | `op` | key-store call latency, seconds |
//!
//! Labels never carry keys, accounts or bodies: their values are the constants
//! below, so the series count is fixed. `docs/metrics.md` has the alarm thresholds.

use std::future::Future;
use std::time::Instant;

use idemkit_core::{Scope, StoreError};
use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

/// Counter `idemkit_requests_total{outcome}`: requests a guarded route answered,
/// one per request, labelled with an [`outcome`].
pub const REQUESTS: &str = "idemkit_requests_total";
/// Gauge `idemkit_in_flight`: requests currently holding a claim in this process
/// (their handler is running or their response is being stored).
pub const IN_FLIGHT: &str = "idemkit_in_flight";
/// Counter `idemkit_fenced_writes_total{op}`: a lease holder's write refused with
/// [`StoreError::Fenced`] because a later attempt took its key over. The
/// refusal itself keeps the record right, but the stale holder's handler ran
/// alongside its successor's, so any effect it had outside the fenced
/// transaction happened twice. Expected to stay at zero; alert on any increase.
/// Heartbeat refusals are not counted: the same attempt's next write is.
pub const FENCED_WRITES: &str = "idemkit_fenced_writes_total";
/// Counter `idemkit_completer_resumes_total{result}`: abandoned records the
/// completer replayed, by `result` (`completed`, `parked`, `unfinished`).
pub const COMPLETER_RESUMES: &str = "idemkit_completer_resumes_total";
/// Gauge `idemkit_orphaned_keys`: abandoned records (claimed, lease expired,
/// never completed) the last completer pass found, at most its batch size.
pub const ORPHANED_KEYS: &str = "idemkit_orphaned_keys";
/// Counter `idemkit_reaper_deleted_total`: completed or released records the
/// reaper deleted past the reap threshold.
pub const REAPER_DELETED: &str = "idemkit_reaper_deleted_total";
/// Counter `idemkit_reaper_review_total`: never-completed records (expired
/// in-flight, parked) the reaper moved to the review list.
pub const REAPER_REVIEW: &str = "idemkit_reaper_review_total";
/// Histogram `idemkit_store_seconds{op}`: the latency of each key-store call, in
/// seconds, by operation ([`op`]).
pub const STORE_SECONDS: &str = "idemkit_store_seconds";

/// Values of the `outcome` label of [`REQUESTS`].
pub mod outcome {
    /// The handler ran and its response is what the key now answers (stored by
    /// the layer, or by `Phases::finish`).
    pub const EXECUTED: &str = "executed";
    /// Answered from the stored response without running the handler.
    pub const REPLAYED: &str = "replayed";
    /// Another request with the key held it: `409 idempotency_request_in_progress`,
    /// or `202` with a status URL in accepted mode.
    pub const IN_PROGRESS: &str = "in_progress";
    /// The key was used before with a different request.
    pub const KEY_REUSED: &str = "key_reused";
    /// No idempotency key.
    pub const KEY_MISSING: &str = "key_missing";
    /// A malformed idempotency key.
    pub const KEY_INVALID: &str = "key_invalid";
    /// The handler ran and the key was released without a stored response
    /// (rejected input, a 5xx under the default policy, a handler error): the
    /// next request with the key runs as a first attempt.
    pub const RELEASED: &str = "released";
    /// The handler ran and gave up its lease to be resumed (marked retryable, or
    /// failed after a phase committed): the next attempt continues from the
    /// recovery point.
    pub const ABANDONED: &str = "abandoned";
    /// The request is parked for human review (now, or by an earlier attempt).
    pub const PARKED: &str = "parked";
    /// A later attempt took the key over while this one ran; its writes were
    /// refused (see [`super::FENCED_WRITES`]).
    pub const LEASE_LOST: &str = "lease_lost";
    /// The key store was unavailable.
    pub const STORE_UNAVAILABLE: &str = "store_unavailable";
    /// Refused before the claim for another reason: no account, a body too large
    /// or failing the route's validation.
    pub const REJECTED: &str = "rejected";
    /// The store failed, or the response could not be stored (too large, body error).
    pub const ERROR: &str = "error";
    /// The completer's resume found the record no longer abandoned as it saw it
    /// (completed, released, reaped or taken over since): nothing ran.
    pub const STALE: &str = "stale";

    /// Every value above, in declaration order: what [`super::start_at_zero`]
    /// registers. A new outcome belongs here too, or its first occurrence is
    /// invisible to `increase()`.
    pub const ALL: &[&str] = &[
        EXECUTED,
        REPLAYED,
        IN_PROGRESS,
        KEY_REUSED,
        KEY_MISSING,
        KEY_INVALID,
        RELEASED,
        ABANDONED,
        PARKED,
        LEASE_LOST,
        STORE_UNAVAILABLE,
        REJECTED,
        ERROR,
        STALE,
    ];
}

/// Values of the `result` label of [`COMPLETER_RESUMES`]: the record's state
/// after the completer replayed it.
pub mod completer_result {
    /// The replay completed the record.
    pub const COMPLETED: &str = "completed";
    /// The replay parked it for review.
    pub const PARKED: &str = "parked";
    /// It is still unfinished (the replay failed, or answered without finishing).
    pub const UNFINISHED: &str = "unfinished";
    /// Every value above.
    pub const ALL: &[&str] = &[COMPLETED, PARKED, UNFINISHED];
}

/// Values of the `op` label of [`STORE_SECONDS`] and [`FENCED_WRITES`].
pub mod op {
    /// Claiming a key (in its own transaction or the handler's).
    pub const CLAIM: &str = "claim";
    /// Storing the response and completing the record.
    pub const COMPLETE: &str = "complete";
    /// Releasing a key without a stored response.
    pub const RELEASE: &str = "release";
    /// Giving up a lease so a later attempt resumes.
    pub const ABANDON: &str = "abandon";
    /// Extending a lease.
    pub const HEARTBEAT: &str = "heartbeat";
    /// Reading a record.
    pub const GET: &str = "get";
    /// Opening a phase's fenced transaction.
    pub const BEGIN_FENCED: &str = "begin_fenced";
    /// Advancing the recovery point inside a phase's transaction.
    pub const ADVANCE: &str = "advance";
    /// Committing a phase's transaction.
    pub const COMMIT: &str = "commit";
    /// Parking a record for review.
    pub const PARK: &str = "park";
    /// Listing abandoned records (completer).
    pub const ABANDONED: &str = "abandoned";
    /// Deleting and moving old records (reaper).
    pub const REAP: &str = "reap";

    /// The lease holder's writes: the `op` values of [`super::FENCED_WRITES`]
    /// (a heartbeat refusal is not counted there).
    pub const WRITES: &[&str] = &[COMPLETE, RELEASE, ABANDON, BEGIN_FENCED, ADVANCE, COMMIT, PARK];
}

/// Registers help texts and units for every metric with the installed
/// recorder, and starts the [`FENCED_WRITES`] alarm at zero for every write, so
/// that its first increase is visible to `increase()` and alert rules.
/// Optional: the metrics are emitted without it. [`start_at_zero`] registers
/// the other series the alerts read.
pub fn describe() {
    for write in op::WRITES {
        counter!(FENCED_WRITES, "op" => *write).increment(0);
    }
    describe_counter!(
        REQUESTS,
        Unit::Count,
        "Requests to idempotency-guarded routes, by outcome."
    );
    describe_gauge!(
        IN_FLIGHT,
        Unit::Count,
        "Requests holding an idempotency claim in this process."
    );
    describe_counter!(
        FENCED_WRITES,
        Unit::Count,
        "Stale lease holders' writes refused (duplicate-side-effect alarm; expected 0)."
    );
    describe_counter!(
        COMPLETER_RESUMES,
        Unit::Count,
        "Abandoned requests the completer replayed, by result."
    );
    describe_gauge!(
        ORPHANED_KEYS,
        Unit::Count,
        "Abandoned records found by the last completer pass."
    );
    describe_counter!(REAPER_DELETED, Unit::Count, "Records the reaper deleted.");
    describe_counter!(
        REAPER_REVIEW,
        Unit::Count,
        "Never-completed records the reaper moved to review."
    );
    describe_histogram!(
        STORE_SECONDS,
        Unit::Seconds,
        "Idempotency key-store call latency, by operation."
    );
}

/// Registers, at zero, every counter and gauge the alert rules
/// (`docs/alerts/idemkit-rules.yml`) read, with every value of their labels:
///
/// - [`REQUESTS`] for each [`outcome::ALL`] (`parked`, `store_unavailable`,
///   `stale`, …);
/// - [`FENCED_WRITES`] for each [`op::WRITES`];
/// - [`COMPLETER_RESUMES`] for each [`completer_result::ALL`];
/// - [`REAPER_DELETED`] and [`REAPER_REVIEW`];
/// - the gauges [`IN_FLIGHT`] and [`ORPHANED_KEYS`] (incremented by zero, so a
///   value already set is kept).
///
/// Call it once after installing the recorder, next to [`describe`]. A
/// counter that first appears at 1 has no earlier sample, so `increase()` over
/// it is empty and an alert on the first park, the first store outage or the
/// first fenced write would never fire. Idempotent: incrementing by zero never
/// changes a value. Series of other crates (the client's
/// `idemkit_client_gave_up_total`) are the application's to register.
pub fn start_at_zero() {
    for outcome in outcome::ALL {
        counter!(REQUESTS, "outcome" => *outcome).increment(0);
    }
    for write in op::WRITES {
        counter!(FENCED_WRITES, "op" => *write).increment(0);
    }
    for result in completer_result::ALL {
        counter!(COMPLETER_RESUMES, "result" => *result).increment(0);
    }
    counter!(REAPER_DELETED).increment(0);
    counter!(REAPER_REVIEW).increment(0);
    gauge!(IN_FLIGHT).increment(0.0);
    gauge!(ORPHANED_KEYS).increment(0.0);
}

/// Counts one request in [`REQUESTS`] with its [`outcome`] label. The HTTP
/// layer counts its own; other adapters over the [`Engine`](crate::Engine)
/// (`idemkit proxy`) call this once per keyed request.
pub fn request(outcome: &'static str) {
    counter!(REQUESTS, "outcome" => outcome).increment(1);
}

/// Runs one store call, recording its latency in [`STORE_SECONDS`] and counting
/// a fenced refusal in [`FENCED_WRITES`] (adapters run their own store calls
/// through it).
pub async fn timed<T>(
    op: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let result = call.await;
    histogram!(STORE_SECONDS, "op" => op).record(started.elapsed().as_secs_f64());
    if matches!(result, Err(StoreError::Fenced)) && op != op::HEARTBEAT {
        counter!(FENCED_WRITES, "op" => op).increment(1);
        tracing::warn!(
            op,
            "idempotency: a stale lease holder's write was refused (fenced)"
        );
    }
    result
}

/// The `outcome` a store failure answers with.
pub fn store_outcome(e: &StoreError) -> &'static str {
    match e {
        StoreError::Fenced => outcome::LEASE_LOST,
        StoreError::Unavailable(_) => outcome::STORE_UNAVAILABLE,
        _ => outcome::ERROR,
    }
}

/// Counts a request as holding a claim until dropped, however the request ends
/// (including a dropped future when the client disconnects).
#[derive(Debug)]
pub struct InFlight(());

impl InFlight {
    /// Enters: [`IN_FLIGHT`] is one higher until the guard drops.
    pub fn enter() -> Self {
        gauge!(IN_FLIGHT).increment(1.0);
        Self(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        gauge!(IN_FLIGHT).decrement(1.0);
    }
}

/// How a response the handler settled itself (`Override::Settled`) counts in
/// [`REQUESTS`]; `idemkit_tower::Phases` attaches it. A settled response without it is
/// `executed`.
#[derive(Debug, Clone, Copy)]
pub struct Settled(pub &'static str);

/// A short, stable digest of (account, key) for logs and spans, so that the
/// lines of one request and its retries can be correlated without writing the
/// raw key or the account (which a resolver may derive from a credential).
pub fn key_hash(scope: &Scope) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"idemkit-log-v1");
    for part in [scope.account.as_str(), scope.key.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..6])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_hash_is_short_stable_and_hides_the_key() {
        let scope = Scope::new(
            idemkit_core::Account::new("acme"),
            idemkit_core::IdempotencyKey::parse("order-42").unwrap(),
        );
        let h = key_hash(&scope);
        assert_eq!(h.len(), 12);
        assert_eq!(h, key_hash(&scope.clone()));
        assert!(!h.contains("order") && !h.contains("acme"));
    }

    /// Every series the alerts read exists at zero after `start_at_zero`, with
    /// every label value, and nothing else is registered.
    #[test]
    fn start_at_zero_registers_every_alerted_series_at_zero() {
        use metrics_util::MetricKind;
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, start_at_zero);
        let mut seen: Vec<(MetricKind, String, Vec<String>)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let zero = match value {
                    DebugValue::Counter(n) => n == 0,
                    DebugValue::Gauge(g) => g.into_inner() == 0.0,
                    DebugValue::Histogram(_) => false,
                };
                let (kind, key) = key.into_parts();
                let labels = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                assert!(zero, "{} starts at zero", key.name());
                (kind, key.name().to_owned(), labels)
            })
            .collect();
        seen.sort();
        let mut want: Vec<(MetricKind, String, Vec<String>)> = Vec::new();
        let counter = |name: &str, label: Option<(&str, &str)>| {
            (
                MetricKind::Counter,
                name.to_owned(),
                label.map(|(k, v)| format!("{k}={v}")).into_iter().collect(),
            )
        };
        for o in outcome::ALL {
            want.push(counter(REQUESTS, Some(("outcome", o))));
        }
        for w in op::WRITES {
            want.push(counter(FENCED_WRITES, Some(("op", w))));
        }
        for r in completer_result::ALL {
            want.push(counter(COMPLETER_RESUMES, Some(("result", r))));
        }
        want.push(counter(REAPER_DELETED, None));
        want.push(counter(REAPER_REVIEW, None));
        want.push((MetricKind::Gauge, IN_FLIGHT.to_owned(), vec![]));
        want.push((MetricKind::Gauge, ORPHANED_KEYS.to_owned(), vec![]));
        want.sort();
        assert_eq!(seen, want);
        assert!(outcome::ALL.contains(&outcome::STALE));
    }

    /// `outcome::ALL` and `completer_result::ALL` list every constant of their
    /// module (read from this file, so a new outcome cannot be left out).
    #[test]
    fn the_all_lists_name_every_constant() {
        let source = include_str!("metrics.rs");
        let values = |module: &str| -> Vec<&str> {
            let start = source.find(&format!("pub mod {module} {{")).unwrap();
            let body = &source[start..];
            let body = &body[..body.find("\n}").unwrap()];
            body.lines()
                .filter_map(|l| l.trim().strip_prefix("pub const "))
                .filter(|l| l.contains(": &str = \""))
                .map(|l| l.split('"').nth(1).unwrap())
                .collect()
        };
        let mut outcomes = values("outcome");
        outcomes.sort_unstable();
        let mut all = outcome::ALL.to_vec();
        all.sort_unstable();
        assert_eq!(all, outcomes);
        let mut results = values("completer_result");
        results.sort_unstable();
        let mut all = completer_result::ALL.to_vec();
        all.sort_unstable();
        assert_eq!(all, results);
    }
}
