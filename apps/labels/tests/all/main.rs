//! Integration tests of idemkit-labels: real HTTP on loopback against in-process
//! servers, one module per area.

use std::time::Duration;

use idemkit_labels::courier::{CourierConfig, RunningCourier, Stats};
use serde_json::Value;

mod courier;
mod create;

/// A courier on a free loopback port with its own temporary SQLite file.
pub(crate) async fn start_courier() -> RunningCourier {
    idemkit_labels::courier::start(CourierConfig::default())
        .await
        .expect("start the courier")
}

/// An HTTP client with a generous timeout (tests set their own where it matters).
pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("reqwest client")
}

/// A label request as the labels service sends it to the courier.
pub(crate) fn label_request(reference: &str) -> Value {
    serde_json::json!({
        "reference": reference,
        "shipFrom": {"name": "Warehouse 1", "country": "DE", "postalCode": "10115"},
        "shipTo": {"name": "Ada Lovelace", "country": "GB", "postalCode": "NW1 6XE"},
        "parcel": {"weightGrams": 1200, "lengthCm": 30, "widthCm": 20, "heightCm": 10},
    })
}

/// `GET /_stats` over HTTP.
pub(crate) async fn courier_stats(base: &str) -> Stats {
    let res = http()
        .get(format!("{base}/_stats"))
        .send()
        .await
        .expect("GET /_stats");
    assert_eq!(res.status(), 200);
    res.json().await.expect("stats JSON")
}
