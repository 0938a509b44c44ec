//! `GET /metrics` on a real `idemkit serve` process (with a real courier).

use crate::labels::{Labels, body, post};

/// The value of the series `series` (name and labels exactly as exposed).
fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_create_and_its_replay() {
    let labels = Labels::start();
    let first = post(&labels.base, "demo-token-acme", &body("k-metrics", "GB")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = post(&labels.base, "demo-token-acme", &body("k-metrics", "GB")).await;
    assert!(again.replayed, "{again:?}");

    let res = reqwest::get(format!("{}/metrics", labels.base)).await.unwrap();
    assert_eq!(res.status(), 200);
    let content_type = res.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    let text = res.text().await.unwrap();
    assert_eq!(
        sample(&text, r#"idemkit_requests_total{outcome="executed"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, r#"idemkit_requests_total{outcome="replayed"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, r#"idemkit_fenced_writes_total{op="complete"}"#),
        Some(0.0),
        "the alarm is exported at zero: {text}"
    );
    assert_eq!(sample(&text, "idemkit_in_flight"), Some(0.0), "{text}");
    assert!(
        text.contains(r#"idemkit_store_seconds_bucket{op="claim","#),
        "store latency is a histogram: {text}"
    );
    assert!(
        !text.contains("k-metrics") && !text.contains("acme"),
        "no key or account in any label: {text}"
    );
}
