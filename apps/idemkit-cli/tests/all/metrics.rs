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

/// Every counter an alert reads exists at zero before the first event (a series
/// born at 1 shows no `increase()`), and every series the shipped alert rules
/// query is in the exposition of a running service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_exist_at_zero_from_startup() {
    let labels = Labels::start();
    let scrape = || async {
        reqwest::get(format!("{}/metrics", labels.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let text = scrape().await;
    for series in [
        r#"idemkit_requests_total{outcome="parked"}"#,
        r#"idemkit_requests_total{outcome="store_unavailable"}"#,
        r#"idemkit_requests_total{outcome="executed"}"#,
        r#"idemkit_requests_total{outcome="key_reused"}"#,
        r#"idemkit_requests_total{outcome="in_progress"}"#,
        r#"idemkit_completer_resumes_total{result="parked"}"#,
        r#"idemkit_completer_resumes_total{result="unfinished"}"#,
        "idemkit_reaper_review_total",
        "idemkit_reaper_deleted_total",
        r#"idemkit_client_gave_up_total{reason="budget_exhausted"}"#,
        r#"idemkit_fenced_writes_total{op="complete"}"#,
        "idemkit_orphaned_keys",
        "idemkit_in_flight",
    ] {
        assert_eq!(sample(&text, series), Some(0.0), "{series} at startup: {text}");
    }

    // After one request (histograms exist once observed), every metric name the
    // rules file queries is exported under exactly that name.
    let first = post(&labels.base, "demo-token-acme", &body("k-rules", "GB")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let text = scrape().await;
    let rules = include_str!("../../../../docs/alerts/idemkit-rules.yml");
    let mut names: Vec<&str> = rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|w| w.starts_with("idemkit_") && w.len() > "idemkit_".len())
        .collect();
    names.sort_unstable();
    names.dedup();
    assert!(names.contains(&"idemkit_store_seconds_bucket"), "{names:?}");
    for name in &names {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))),
            "the rules query `{name}`, which the service does not export: {text}"
        );
    }
    assert!(
        text.contains(r#"idemkit_store_seconds_bucket{op="claim",le="0.05"}"#),
        "the latency alert's 50 ms threshold is a bucket bound: {text}"
    );
}
