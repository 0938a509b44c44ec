//! The contract follows the configuration it is given, and the router serves it.

use std::time::Duration;

use http_body_util::BodyExt;
use idemkit_client::RetryConfig;
use idemkit_contract::{Contract, DEADLINE_HEADER_DISPLAY, Format, IdemkitConfig, RouteExample, render};
use serde_json::json;
use tower::ServiceExt;

const LABELS_LIKE: &str = "[defaults]\nreplay_window = \"24h\"\nreap_threshold = \"72h\"\nlease = \"30s\"\n\
    [[routes]]\nmethod = \"POST\"\npath = \"/labels\"\nkey_field = \"/idempotencyKey\"\nreplay_status = 200\n\
    longest_retry_chain = \"1h\"\n";

#[test]
fn the_contract_follows_the_configuration() {
    let config = IdemkitConfig::from_toml(LABELS_LIKE).unwrap();
    let doc = render(&config, &RetryConfig::new(), Format::Markdown);
    assert!(doc.contains("replays for **24 h**"), "{doc}");
    assert!(doc.contains("kept **72 h**"));
    assert!(doc.contains("lease of **30s**"));
    assert!(doc.contains("200 for a stored 2xx"));
    assert!(doc.contains("\"status\": 409, \"code\": \"idempotency_key_reused\""));
    assert!(doc.contains("**3 attempts**"));
    assert!(doc.contains("| 3 | 0 – 100ms |"));
    assert!(doc.contains("## Deadlines") && doc.contains("`Request-Timeout: <milliseconds>`"));
    assert!(DEADLINE_HEADER_DISPLAY.eq_ignore_ascii_case(idemkit_core::wire::REQUEST_TIMEOUT));

    let changed = IdemkitConfig::from_toml(
        "[defaults]\nreplay_window = \"2h\"\nreap_threshold = \"6h\"\nmismatch_status = 422\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/labels\"\nkey_field = \"/idempotencyKey\"\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/legacy\"\nretry_safe = false\n",
    )
    .unwrap();
    let client = RetryConfig::new()
        .with_max_attempts(5)
        .with_backoff(idemkit_client::Backoff::full_jitter(
            Duration::from_millis(100),
            Duration::from_secs(1),
        ));
    let doc = render(&changed, &client, Format::Markdown);
    assert!(doc.contains("replays for **2 h**"), "{doc}");
    assert!(doc.contains("kept **6 h**"));
    assert!(doc.contains("\"status\": 422, \"code\": \"idempotency_key_reused\""));
    assert!(doc.contains("| the stored status |"));
    assert!(doc.contains("**5 attempts**"));
    assert!(doc.contains("| 5 | 0 – 800ms |"));
    assert!(doc.contains("not retry-safe") && doc.contains("`POST /legacy`"));
    let html = render(&changed, &client, Format::Html);
    assert!(html.starts_with("<!doctype html>") && html.contains("<table>"));
}

#[test]
fn service_specific_parts_are_data() {
    let config = IdemkitConfig::from_toml(LABELS_LIKE).unwrap();
    let plain = Contract::new(config.clone()).render(Format::Markdown);
    assert!(
        plain.contains("\"idempotencyKey\":\"order-4711-label\""),
        "{plain}"
    );
    assert!(!plain.contains("## gRPC"), "no service's section unless given");

    let contract = Contract::new(config)
        .with_example(
            "POST",
            "/labels",
            RouteExample {
                body: json!({"courier": "ups"}),
                different: json!({"courier": "dhl"}),
            },
        )
        .with_section("## gRPC\n\nThe same API over gRPC.\n");
    let doc = contract.render(Format::Markdown);
    let first = r#"-d '{"courier":"ups","idempotencyKey":"order-4711-label"}'"#;
    let other = r#"-d '{"courier":"dhl","idempotencyKey":"order-4711-label"}'"#;
    assert!(doc.contains(first) && doc.contains(other), "{doc}");
    let grpc = doc.find("## gRPC").expect("the section is there");
    assert!(doc.find("## Examples").unwrap() < grpc && grpc < doc.find("## Policy as data").unwrap());

    let op = &contract.openapi_fragment()["paths"]["/labels"]["post"];
    assert!(op.get("parameters").is_none(), "no header for a body-keyed route");
    assert_eq!(
        op["requestBody"]["content"]["application/json"]["schema"]["required"],
        json!(["idempotencyKey"])
    );
    let route = contract.config().route("POST", "/labels").unwrap();
    assert_eq!(op["x-idempotency"], idemkit_contract::x_idempotency(route));
}

#[tokio::test]
async fn the_router_serves_the_running_configuration() {
    let config = IdemkitConfig::from_toml(LABELS_LIKE).unwrap();
    let contract = Contract::new(config);
    let app: axum::Router = idemkit_contract::router(&contract);

    let get = |path: &'static str| {
        let app = app.clone();
        async move {
            let res = app
                .oneshot(http::Request::get(path).body(axum::body::Body::empty()).unwrap())
                .await
                .unwrap();
            let status = res.status();
            let ct = res.headers()["content-type"].to_str().unwrap().to_owned();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, ct, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    let (status, ct, page) = get("/docs/idempotency").await;
    assert_eq!(status, 200);
    assert!(ct.starts_with("text/html"), "{ct}");
    assert!(page.contains("<code>POST /labels</code>"), "{page}");
    let (status, ct, json) = get("/docs/idempotency.json").await;
    assert_eq!(status, 200);
    assert!(ct.starts_with("application/json"));
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(doc, contract.policy_document());
    assert_eq!(doc["operations"][0]["path"], "/labels");
}

#[test]
fn the_html_page_is_styled_standalone_and_draws_the_schedule() {
    let config = IdemkitConfig::from_toml(LABELS_LIKE).unwrap();
    let client = RetryConfig::new().with_max_attempts(4);
    let html = render(&config, &client, Format::Html);
    assert!(
        html.contains("<style>") && html.contains("name=\"viewport\""),
        "embedded stylesheet"
    );
    assert!(!html.contains("<link") && !html.contains("<script") && !html.contains("<img"));
    let svg = &html[html.find("<svg class=\"timeline\"").expect("the timeline")..];
    let svg = &svg[..svg.find("</svg>").unwrap()];
    for n in 1..=4 {
        assert!(
            svg.contains(&format!(">attempt {n}</text>")),
            "a row per attempt: {svg}"
        );
    }
    assert!(!svg.contains(">attempt 5<"));
    assert_eq!(
        svg.matches("class=\"range\"").count(),
        3,
        "attempts 2-4 start in a range"
    );
    assert!(svg.contains("deadline"), "the default deadline is drawn");
    // Right under the worked schedule's table, before the text that follows it.
    let table_end = html
        .find("<td>4</td>")
        .expect("the schedule table has a row for attempt 4");
    let svg_at = html.find("<svg class=\"timeline\"").unwrap();
    assert!(table_end < svg_at && svg_at < html.find("Then the call returns its last error").unwrap());
    // Markdown carries no SVG (it renders nowhere integrators read Markdown).
    assert!(!render(&config, &client, Format::Markdown).contains("<svg"));
}

/// The wording each mode's routes get, and what only a service with gRPC or
/// its own endpoints is told.
const SINGLE_STEP_WORDS: [&str; 2] = [
    "**If you hang up mid-request, the request is cut short and rolled back.**",
    "still running when your deadline passes is **cut short**: it is answered `504` with `code` `deadline_exceeded`",
];
const LEASE_WORDS: [&str; 2] = [
    "**If you hang up mid-request, the request still runs to its end.**",
    "A request is not cut short when your deadline passes",
];

#[test]
fn a_single_step_configuration_gets_the_single_step_contract() {
    let config = IdemkitConfig::from_toml(
        "[defaults]\nmode = \"single_step\"\n[[routes]]\nmethod = \"POST\"\npath = \"/orders\"\n",
    )
    .unwrap();
    let doc = Contract::new(config).render(Format::Markdown);
    for words in SINGLE_STEP_WORDS {
        assert!(doc.contains(words), "{words} missing in\n{doc}");
    }
    for words in LEASE_WORDS {
        assert!(!doc.contains(words), "{words} in\n{doc}");
    }
    assert!(!doc.contains("lease of **"), "{doc}");
}

#[test]
fn a_lease_configuration_gets_the_lease_contract() {
    let config = IdemkitConfig::from_toml(LABELS_LIKE).unwrap();
    let doc = Contract::new(config).render(Format::Markdown);
    for words in LEASE_WORDS {
        assert!(doc.contains(words), "{words} missing in\n{doc}");
    }
    for words in SINGLE_STEP_WORDS {
        assert!(!doc.contains(words), "{words} in\n{doc}");
    }
}

#[test]
fn mixed_modes_name_each_routes_mode() {
    let config = IdemkitConfig::from_toml(
        "[[routes]]\nmethod = \"POST\"\npath = \"/orders\"\nmode = \"single_step\"\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/emails\"\n",
    )
    .unwrap();
    let doc = Contract::new(config).render(Format::Markdown);
    assert!(doc.contains("On `POST /emails` (lease mode):"), "{doc}");
    assert!(doc.contains("On `POST /orders` (single-step mode):"), "{doc}");
    for words in SINGLE_STEP_WORDS.iter().chain(&LEASE_WORDS) {
        assert!(doc.contains(words), "{words} missing in\n{doc}");
    }
}

#[test]
fn grpc_and_service_endpoints_only_when_configured() {
    let plain = Contract::new(IdemkitConfig::from_toml(LABELS_LIKE).unwrap()).render(Format::Markdown);
    for absent in ["gRPC", "grpc-timeout", "/openapi.json", "GET /docs/idempotency"] {
        assert!(!plain.contains(absent), "{absent} in\n{plain}");
    }
    let with = IdemkitConfig::from_toml(&format!(
        "[service]\ngrpc = true\nopenapi = \"/api.json\"\ncontract_routes = true\n{LABELS_LIKE}"
    ))
    .unwrap();
    let doc = Contract::new(with).render(Format::Markdown);
    assert!(
        doc.contains("Over gRPC the deadline is the standard `grpc-timeout`"),
        "{doc}"
    );
    assert!(doc.contains("every keyed operation of `GET /api.json`"), "{doc}");
    assert!(doc.contains("`GET /docs/idempotency.json` serves it"), "{doc}");
}
