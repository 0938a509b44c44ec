//! The completer, the reaper (the behaviour contract, `docs/spec.md` §7) and
//! the operator's release (`idemkit keys release`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{HeaderName, HeaderValue, Request};
use idemkit_core::{
    IntoKeyStore, KeyStore, Millis, Policy, ReapReport, Record, RecordState, Scope, StoreResult,
};
use tower::{Service, ServiceExt};

use crate::metrics::{self, op, timed};
use idemkit_engine::Resume;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one completer pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompleterReport {
    /// Abandoned records found.
    pub found: usize,
    /// Records driven to completion.
    pub completed: usize,
    /// Records parked for review along the way.
    pub parked: usize,
    /// Records still not complete, with what the replay answered.
    pub unfinished: Vec<(Scope, String)>,
}

/// Drives abandoned in-flight requests (lease expired, claimed at least
/// `min_age` ago) to completion with no client retry, by replaying each stored
/// request through the application itself (its router, with the idempotency
/// layers in front): the layer takes the record over with a new fencing token and
/// the route's handler resumes from the recovery point, exactly as a client retry
/// would. The response is stored for the client's next retry.
///
/// A lease-mode service runs one beside its router, with the reaper:
///
/// ```no_run
/// use std::time::Duration;
///
/// use axum::{Router, routing::post};
/// use idemkit_core::Policy;
/// use idemkit_tower::{BearerTokenAccount, Completer, IdempotencyLayer, Reaper};
///
/// # async fn run(store: idemkit_sqlite::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// let policy = Policy::new();
/// let keys = IdempotencyLayer::lease(store.clone(), BearerTokenAccount::new("server secret"))
///     .policy(policy.clone())
///     .build()?;
/// let app: Router = Router::new().route("/emails", post(|| async { "sent" }).layer(keys));
/// // Every two leases, take over what an attempt abandoned at least one lease ago,
/// // by replaying its stored request through the application itself.
/// Completer::new(store.clone(), app.clone()).min_age(policy.lease).spawn(policy.lease * 2);
/// // Hourly, delete what is past the reap threshold; park what never completed.
/// Reaper::new(store, &policy).spawn(Duration::from_secs(3600));
/// axum::serve(tokio::net::TcpListener::bind("127.0.0.1:3000").await?, app).await?;
/// # Ok(()) }
/// ```
pub struct Completer<S> {
    store: Arc<dyn KeyStore>,
    app: S,
    min_age: Duration,
    batch: usize,
}

impl<S> std::fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("min_age", &self.min_age)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl<S, B> Completer<S>
where
    S: Service<Request<Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    /// A completer for the records of `store`, replayed through `app`. Defaults:
    /// records abandoned for at least a minute, 100 per pass. The store is
    /// taken as the layers take it: by value, as an `Arc<S>` or as an
    /// `Arc<dyn KeyStore>`.
    pub fn new(store: impl IntoKeyStore, app: S) -> Self {
        Self {
            store: store.into_key_store(),
            app,
            min_age: Duration::from_secs(60),
            batch: 100,
        }
    }

    /// Only records claimed at least this long ago are taken.
    pub fn min_age(mut self, d: Duration) -> Self {
        self.min_age = d;
        self
    }

    /// At most this many records per pass.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n;
        self
    }

    fn request_for(record: &Record) -> Result<Request<Body>, BoxError> {
        let mut req = Request::builder()
            .method(record.request.method.as_str())
            .uri(record.request.path.as_str());
        for h in &record.request.headers {
            req = req.header(
                HeaderName::from_bytes(h.name.as_bytes())?,
                HeaderValue::from_bytes(&h.value)?,
            );
        }
        let mut req = req.body(Body::from(record.request.body.clone()))?;
        req.extensions_mut()
            .insert(Resume::new(record.scope.clone(), record.fencing_token));
        Ok(req)
    }

    /// One pass (the operator CLI's entry point). Sets the
    /// [`metrics::ORPHANED_KEYS`] gauge to the records found and counts each
    /// replay in [`metrics::COMPLETER_RESUMES`] by result.
    pub async fn run_once(&self) -> StoreResult<CompleterReport> {
        let cutoff = self.store.now().minus(self.min_age);
        let records = timed(op::ABANDONED, self.store.abandoned(cutoff, self.batch)).await?;
        ::metrics::gauge!(metrics::ORPHANED_KEYS).set(records.len() as f64);
        let mut report = CompleterReport {
            found: records.len(),
            ..CompleterReport::default()
        };
        for record in records {
            let answer = match Self::request_for(&record) {
                Ok(req) => match self.app.clone().oneshot(req).await {
                    Ok(res) => format!("answered {}", res.status()),
                    Err(e) => format!("failed: {}", e.into()),
                },
                Err(e) => format!("stored request is not replayable: {e}"),
            };
            let result = match timed(op::GET, self.store.get(&record.scope))
                .await?
                .map(|r| r.state)
            {
                Some(RecordState::Completed) => {
                    report.completed += 1;
                    "completed"
                }
                Some(RecordState::Parked) => {
                    report.parked += 1;
                    "parked"
                }
                _ => {
                    tracing::warn!(%answer, "idempotency completer: record still unfinished");
                    report.unfinished.push((record.scope, answer));
                    "unfinished"
                }
            };
            ::metrics::counter!(metrics::COMPLETER_RESUMES, "result" => result).increment(1);
        }
        if report.found > 0 {
            tracing::info!(
                found = report.found,
                completed = report.completed,
                parked = report.parked,
                "idempotency completer pass"
            );
        }
        Ok(report)
    }

    /// Runs a pass every `every` in a background task.
    pub fn spawn(self, every: Duration) -> tokio::task::JoinHandle<()>
    where
        S: Sync,
    {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                if let Err(e) = self.run_once().await {
                    tracing::warn!(error = %e, "idempotency completer pass failed");
                }
            }
        })
    }
}

/// Deletes records past the reap threshold and moves requests that never
/// completed to the store's review list (with their recovery point and last
/// error) for humans.
#[derive(Debug, Clone)]
pub struct Reaper {
    store: Arc<dyn KeyStore>,
    threshold: Duration,
}

/// A reap threshold shorter than the replay window: completed records would be
/// deleted while a retry may still expect their replay, and run the write again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a reap threshold of {threshold:?} is shorter than the replay window of {replay_window:?}: \
     completed records would be deleted while retries still expect their replay"
)]
pub struct ReapThresholdTooShort {
    /// The threshold asked for.
    pub threshold: Duration,
    /// The replay window it must not undercut.
    pub replay_window: Duration,
}

impl Reaper {
    /// A reaper for records older than the policy's reap threshold (which policy
    /// validation keeps at or above its replay window).
    pub fn new(store: impl IntoKeyStore, policy: &Policy) -> Self {
        Self {
            store: store.into_key_store(),
            threshold: policy.reap_threshold.max(policy.replay_window),
        }
    }

    /// A reaper for records older than `threshold`, refused when it is shorter
    /// than `replay_window` (the longest replay window of the routes the store
    /// serves): reaping a completed record inside its window would let a retry
    /// run the write again.
    pub fn with_threshold(
        store: Arc<dyn KeyStore>,
        threshold: Duration,
        replay_window: Duration,
    ) -> Result<Self, ReapThresholdTooShort> {
        if threshold < replay_window {
            return Err(ReapThresholdTooShort {
                threshold,
                replay_window,
            });
        }
        Ok(Self { store, threshold })
    }

    /// One pass (the operator CLI's entry point). Counts what it did in
    /// [`metrics::REAPER_DELETED`] and [`metrics::REAPER_REVIEW`].
    pub async fn run_once(&self) -> StoreResult<ReapReport> {
        let report = timed(op::REAP, self.store.reap(self.store.now().minus(self.threshold))).await?;
        ::metrics::counter!(metrics::REAPER_DELETED).increment(report.deleted);
        ::metrics::counter!(metrics::REAPER_REVIEW).increment(report.moved_to_review);
        if report.deleted + report.moved_to_review > 0 {
            tracing::info!(
                deleted = report.deleted,
                to_review = report.moved_to_review,
                "idempotency reaper pass"
            );
        }
        Ok(report)
    }

    /// Runs a pass every `every` in a background task.
    pub fn spawn(self, every: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                if let Err(e) = self.run_once().await {
                    tracing::warn!(error = %e, "idempotency reaper pass failed");
                }
            }
        })
    }
}

/// What [`release_key`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Released {
    /// Released with its recorded progress kept: the next request with the
    /// key resumes from its recovery point (`KeyStore::force_release`).
    KeptProgress,
    /// Released and its progress discarded: the next request runs as a
    /// first attempt (`KeyStore::discard_progress`).
    DiscardedProgress,
}

/// Why [`release_key`] did not release a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseRefused {
    /// No record with this account and key.
    NoRecord,
    /// Completed: its answer is replayed until the replay window ends.
    Completed,
    /// Already released.
    AlreadyReleased,
    /// Held by a lease that has not run out.
    LiveLease {
        /// When the lease ends.
        until: Millis,
    },
    /// A state the operator does not release.
    State(RecordState),
    /// The record could be released when it was read, but the store refused
    /// the write: a holder claimed it meanwhile.
    Raced,
}

/// `idemkit keys release`: frees a parked record, or an in-flight one whose
/// lease ran out, so the next request with its key runs. With
/// `downstream_did_nothing` (the operator checked every downstream the
/// request calls and found no effect of it), recorded progress is discarded
/// and the next request runs as a first attempt; without it, progress is kept
/// and the next request resumes (a call with an intent and no result parks
/// again rather than call a downstream that ignores keys twice). Completed
/// and released records, and live leases, are refused. The store's own
/// write decides a race: a holder that claimed the record after the read
/// makes it [`ReleaseRefused::Raced`].
pub async fn release_key(
    store: &dyn KeyStore,
    scope: &Scope,
    downstream_did_nothing: bool,
) -> StoreResult<Result<Released, ReleaseRefused>> {
    let now = store.now();
    let record = match timed(op::GET, store.get(scope)).await? {
        None => return Ok(Err(ReleaseRefused::NoRecord)),
        Some(r) => r,
    };
    match record.state {
        RecordState::Completed => return Ok(Err(ReleaseRefused::Completed)),
        RecordState::Released => return Ok(Err(ReleaseRefused::AlreadyReleased)),
        RecordState::InFlight if record.lease_expires_at > now => {
            return Ok(Err(ReleaseRefused::LiveLease {
                until: record.lease_expires_at,
            }));
        }
        RecordState::InFlight | RecordState::Parked => {}
        other => return Ok(Err(ReleaseRefused::State(other))),
    }
    let discard = downstream_did_nothing && record.has_progress();
    let released = if discard {
        store.discard_progress(scope).await?
    } else {
        store.force_release(scope).await?
    };
    Ok(match (released, discard) {
        (false, _) => Err(ReleaseRefused::Raced),
        (true, true) => Ok(Released::DiscardedProgress),
        (true, false) => Ok(Released::KeptProgress),
    })
}

#[cfg(test)]
mod tests {
    /// The completer labels its resumes with the very strings the metrics
    /// module lists.
    #[test]
    fn the_completer_labels_its_resumes_with_the_listed_results() {
        let jobs = include_str!("jobs.rs");
        for r in crate::metrics::completer_result::ALL {
            assert!(jobs.contains(&format!("\"{r}\"")), "jobs.rs labels `{r}`");
        }
    }
}
