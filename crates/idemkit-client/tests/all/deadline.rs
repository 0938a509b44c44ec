//! The overall deadline under tokio's paused clock: a 2 s deadline against a server
//! that always answers 503 after 300 ms.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use idemkit_client::{Backoff, Jitter, RetryConfig, RetryLayer, RetryPolicy, Stop, Unlimited};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};

const LATENCY: Duration = Duration::from_millis(300);
const DEADLINE: Duration = Duration::from_secs(2);

async fn run_once(seed: u64, jitter: Jitter) {
    let started_attempts = Arc::new(AtomicU32::new(0));
    let finished_attempts = Arc::new(AtomicU32::new(0));
    let server = {
        let (started, finished) = (started_attempts.clone(), finished_attempts.clone());
        tower::service_fn(move |_req: Request<Full<Bytes>>| {
            let (started, finished) = (started.clone(), finished.clone());
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(LATENCY).await;
                finished.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(
                    Response::builder()
                        .status(StatusCode::SERVICE_UNAVAILABLE)
                        .body(Full::new(Bytes::new()))
                        .unwrap(),
                )
            }
        })
    };
    let config = RetryConfig::new()
        .with_max_attempts(1_000)
        .with_deadline(DEADLINE)
        .with_backoff(Backoff::TRANSIENT.with_cap(Duration::from_millis(500)))
        .with_jitter(jitter);
    let policy = RetryPolicy::new(config)
        .with_budget(Arc::new(Unlimited))
        .with_seed(seed);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(server);

    let t0 = Instant::now();
    let err = svc
        .oneshot(
            Request::post("http://svc/x")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap_err();
    let took = t0.elapsed();

    assert!(took <= DEADLINE, "seed {seed}: returned after {took:?}");
    assert_eq!(err.stop(), Stop::DeadlineExceeded, "seed {seed}");
    let started = started_attempts.load(Ordering::SeqCst);
    assert_eq!(
        started,
        finished_attempts.load(Ordering::SeqCst),
        "seed {seed}: an attempt was started that could not finish"
    );
    assert_eq!(started, err.attempts());
    assert!(started >= 3, "seed {seed}: only {started} attempts");
    // It gave up because the next attempt could not fit, not much earlier.
    assert!(
        took + LATENCY + Duration::from_millis(500) > DEADLINE,
        "seed {seed}: {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_is_never_exceeded_and_no_attempt_is_cut_short() {
    for seed in 0..100 {
        run_once(seed, Jitter::Full).await;
        run_once(seed, Jitter::Decorrelated).await;
    }
}
