//! `idemkit lint-openapi` on real payment-API documents (committed with their
//! licences under `tests/fixtures/openapi/`), on hand-made documents for every rule,
//! and on the labels service's own OpenAPI and generated contract.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{Value, json};

use crate::{Run, idemkit};

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/openapi")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

async fn lint(source: &str, extra: &[&str]) -> Run {
    let mut args = vec!["lint-openapi".to_owned(), source.to_owned(), "--json".to_owned()];
    args.extend(extra.iter().map(|s| s.to_string()));
    idemkit(args).await
}

fn summary(run: &Run) -> BTreeMap<String, u64> {
    run.report()["summary"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect()
}

fn counts(keyed: u64, retry_unsafe: u64, claimed: u64, safe: u64, missing: u64) -> BTreeMap<String, u64> {
    [
        ("keyed", keyed),
        ("retry_unsafe", retry_unsafe),
        ("claimed_idempotent", claimed),
        ("safe", safe),
        ("missing", missing),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// `"METHOD path" → (verdict, key)` for every operation.
fn verdicts(run: &Run) -> BTreeMap<String, (String, Value)> {
    run.report()["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                format!(
                    "{} {}",
                    o["method"].as_str().unwrap(),
                    o["path"].as_str().unwrap()
                ),
                (o["verdict"].as_str().unwrap().to_owned(), o["key"].clone()),
            )
        })
        .collect()
}

fn notes(run: &Run, op: &str) -> Vec<String> {
    run.report()["operations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| {
            format!(
                "{} {}",
                o["method"].as_str().unwrap(),
                o["path"].as_str().unwrap()
            ) == op
        })
        .unwrap_or_else(|| panic!("no {op}"))["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect()
}

/// Square keys its writes with a body field (`idempotency_key`).
#[tokio::test]
async fn square_body_field_keys() {
    let run = lint(&fixture("square.json"), &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(summary(&run), counts(38, 0, 24, 0, 54), "{}", run.stdout);
    let v = verdicts(&run);
    assert_eq!(
        v["POST /v2/payments"],
        ("keyed".into(), json!({"in": "body", "name": "/idempotency_key"}))
    );
    // A search is a read, but the document does not say so: never guessed.
    assert_eq!(v["POST /v2/customers/search"].0, "missing");
    assert_eq!(v["DELETE /v2/customers/{customer_id}"].0, "claimed_idempotent");
}

/// Adyen keys its writes with an `Idempotency-Key` header.
#[tokio::test]
async fn adyen_header_keys() {
    let run = lint(&fixture("adyen-checkout-v71.json"), &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(summary(&run), counts(20, 0, 1, 0, 1), "{}", run.stdout);
    let v = verdicts(&run);
    assert_eq!(
        v["POST /payments"],
        ("keyed".into(), json!({"in": "header", "name": "Idempotency-Key"}))
    );
    assert_eq!(v["PATCH /paymentLinks/{linkId}"].0, "missing");
    let n = notes(&run, "POST /payments");
    assert!(n.iter().any(|n| n.contains("is optional")), "{n:?}");
    assert!(n.iter().any(|n| n.contains("do not document 409")), "{n:?}");
    assert!(n.iter().any(|n| n.contains("replay marker")), "{n:?}");
}

/// One hand-made operation per rule (OpenAPI 3.1 in YAML).
#[tokio::test]
async fn every_rule_on_a_hand_made_document() {
    let run = lint(&fixture("rules-oas31.yaml"), &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let header = |n: &str| json!({"in": "header", "name": n});
    let body = |n: &str| json!({"in": "body", "name": n});
    let want: BTreeMap<String, (String, Value)> = [
        ("POST /header-keyed", "keyed", header("Idempotency-Key")),
        ("POST /header-lowercase", "keyed", header("idempotency-key")),
        ("POST /optional-header", "keyed", header("Idempotency-Key")),
        ("POST /body-keyed", "keyed", body("/idempotency_key")),
        ("PATCH /body-camel", "keyed", body("/idempotencyKey")),
        ("POST /unkeyed", "missing", Value::Null),
        ("PATCH /unkeyed", "missing", Value::Null),
        ("PUT /things/{id}", "claimed_idempotent", Value::Null),
        ("DELETE /things/{id}", "claimed_idempotent", Value::Null),
        ("PUT /keyed-put/{id}", "keyed", header("Idempotency-Key")),
        ("POST /search", "safe", Value::Null),
        ("POST /search-by-name", "missing", Value::Null),
        ("POST /legacy", "retry_unsafe", Value::Null),
        ("POST /published", "keyed", header("X-Request-Key")),
        ("POST /published-undeclared", "keyed", body("/requestId")),
        ("POST /remote-ref", "missing", Value::Null),
    ]
    .into_iter()
    .map(|(op, v, k)| (op.to_owned(), (v.to_owned(), k)))
    .collect();
    assert_eq!(verdicts(&run), want, "{}", run.stdout);
    assert_eq!(summary(&run), counts(8, 1, 2, 1, 4));

    assert!(
        notes(&run, "POST /header-keyed").is_empty(),
        "a complete keyed operation"
    );
    assert!(
        notes(&run, "POST /body-keyed").is_empty(),
        "the replay marker named in a description counts"
    );
    let has = |op: &str, text: &str| notes(&run, op).iter().any(|n| n.contains(text));
    assert!(has("POST /header-lowercase", "do not document 409"));
    assert!(has(
        "POST /header-lowercase",
        "replay marker `Idempotent-Replayed`"
    ));
    assert!(has("POST /optional-header", "is optional"));
    assert!(has("POST /optional-header", "documented only through 4XX"));
    assert!(has("PATCH /body-camel", "`idempotencyKey` is optional"));
    assert!(
        has("POST /published", "do not document 422"),
        "the policy's mismatch status"
    );
    assert!(
        !has("POST /published", "replay marker"),
        "published in x-idempotency"
    );
    assert!(has("POST /published-undeclared", "does not declare"));
    assert!(has("POST /remote-ref", "leaves the document: not followed"));
    assert!(has(
        "PUT /things/{id}",
        "idemkit check --gates claimed-idempotent"
    ));
    assert!(
        !verdicts(&run).keys().any(|k| k.starts_with("GET ")),
        "reads are not listed"
    );

    // The table groups by verdict, missing first, with counts.
    let table = idemkit(vec!["lint-openapi".into(), fixture("rules-oas31.yaml")]).await;
    assert_eq!(table.code, 1);
    let at = |s: &str| {
        table
            .stdout
            .find(s)
            .unwrap_or_else(|| panic!("{s}: {}", table.stdout))
    };
    assert!(at("missing (4)") < at("claimed_idempotent (2)"));
    assert!(at("claimed_idempotent (2)") < at("retry_unsafe (1)"));
    assert!(at("safe (1)") < at("keyed (8)"));
    assert!(table.stdout.contains(
        "16 operation(s): 4 missing, 2 claimed_idempotent, 1 retry_unsafe, 1 safe, 8 keyed → exit 1"
    ));
}

#[tokio::test]
async fn swagger_2_header_body_and_form_keys() {
    let run = lint(&fixture("rules-swagger2.json"), &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let v = verdicts(&run);
    assert_eq!(
        v["POST /charges"].1,
        json!({"in": "header", "name": "Idempotency-Key"})
    );
    assert_eq!(
        v["POST /refunds"].1,
        json!({"in": "body", "name": "/idempotency_key"})
    );
    assert_eq!(
        v["POST /forms"].1,
        json!({"in": "body", "name": "/idempotency_key"})
    );
    assert_eq!(v["DELETE /things/{id}"].0, "claimed_idempotent");
    assert_eq!(v["POST /things/{id}"].0, "missing");
}

/// Other key names are named on the command line; with nothing missing, exit 0.
#[tokio::test]
async fn custom_key_names_and_exit_0() {
    let run = lint(&fixture("all-covered.json"), &[]).await;
    assert_eq!(
        run.code, 1,
        "the default names miss X-Request-Id and request_id: {run:#?}"
    );
    let run = lint(
        &fixture("all-covered.json"),
        &["--key-header", "x-request-id", "--key-field", "request_id"],
    )
    .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(summary(&run), counts(2, 1, 0, 1, 0));
    // The JSON has exactly the documented shape.
    let report = run.report();
    let top: Vec<&String> = report.as_object().unwrap().keys().collect();
    assert_eq!(top, ["operations", "summary"]);
    let op = &report["operations"][0];
    let mut keys: Vec<&String> = op.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["key", "method", "notes", "operationId", "path", "verdict"]);
}

#[tokio::test]
async fn unreadable_documents_exit_2() {
    for (source, says) in [
        (fixture("not-openapi.json"), "not an OpenAPI document"),
        (fixture("broken.yaml"), "parsing YAML"),
        (fixture("no-such-file.json"), "reading"),
    ] {
        let run = lint(&source, &[]).await;
        assert_eq!(run.code, 2, "{run:#?}");
        assert!(run.stderr.contains(says), "{run:#?}");
        assert!(run.stdout.is_empty(), "{run:#?}");
    }
}

/// A 3 MB document (Square's, its paths copied under prefixes until it weighs
/// 3 MB) is linted in well under a second in a release build; the bound here is
/// loose for debug builds on a busy machine.
#[tokio::test]
async fn a_3_mb_document_is_fast() {
    let mut doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("square.json")).unwrap()).unwrap();
    let paths = doc["paths"].as_object().unwrap().clone();
    let mut copy = 0;
    while serde_json::to_vec(&doc).unwrap().len() < 3 * 1024 * 1024 {
        copy += 1;
        for (p, item) in &paths {
            doc["paths"][format!("/copy{copy}{p}")] = item.clone();
        }
    }
    let size = serde_json::to_vec(&doc).unwrap().len();
    let file = std::env::temp_dir().join(format!("idemkit-lint-3mb-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_vec(&doc).unwrap()).unwrap();
    let started = std::time::Instant::now();
    let run = lint(file.to_str().unwrap(), &[]).await;
    let took = started.elapsed();
    let _ = std::fs::remove_file(&file);
    assert_eq!(run.code, 1, "{run:#?}");
    let ops = run.report()["operations"].as_array().unwrap().len();
    assert_eq!(ops, 116 * (copy + 1));
    println!("lint-openapi: {size} bytes, {ops} operations in {took:?} (process start included)");
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
}

/// The labels service's own OpenAPI (over HTTP) passes: nothing missing, its two
/// writes keyed where `x-idempotency` says (the body; OASIS Repeatable Requests
/// headers), with no notes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_labels_openapi_passes_the_lint() {
    let labels = crate::labels::Labels::start();
    let run = lint(&format!("{}/openapi.json", labels.base), &[]).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(summary(&run), counts(2, 0, 0, 0, 0));
    assert_eq!(
        verdicts(&run)["POST /labels"],
        ("keyed".into(), json!({"in": "body", "name": "/idempotencyKey"}))
    );
    assert!(notes(&run, "POST /labels").is_empty(), "{run:#?}");
    assert_eq!(
        verdicts(&run)["POST /repeatable/labels"],
        (
            "keyed".into(),
            json!({"in": "header", "name": "Repeatability-Request-ID"})
        )
    );
    assert!(notes(&run, "POST /repeatable/labels").is_empty(), "{run:#?}");

    // The policy document next to the contract holds the same x-idempotency.
    let openapi: Value = reqwest::get(format!("{}/openapi.json", labels.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let policy: Value = reqwest::get(format!("{}/docs/idempotency.json", labels.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        policy["operations"][0]["x-idempotency"],
        openapi["paths"]["/labels"]["post"]["x-idempotency"]
    );
    assert_eq!(
        policy["operations"][0]["x-idempotency"]["key"]["name"],
        "/idempotencyKey"
    );
    assert_eq!(
        policy["operations"][0]["x-idempotency"]["leaseSeconds"], 1,
        "the --lease-ms it runs with"
    );
}

/// The generated contract's OpenAPI fragment is itself a document the lint passes
/// with no notes: the key where it really travels, the conflicts, the marker.
#[tokio::test]
async fn the_generated_fragment_passes_the_lint() {
    let docs = idemkit(vec!["docs".into()]).await;
    assert_eq!(docs.code, 0, "{docs:#?}");
    let fragment = docs
        .stdout
        .split("## OpenAPI fragment")
        .nth(1)
        .and_then(|s| s.split("```json\n").nth(1))
        .and_then(|s| s.split("\n```").next())
        .unwrap_or_else(|| panic!("no fragment in {}", docs.stdout));
    let mut doc: Value = serde_json::from_str(fragment).unwrap();
    doc["openapi"] = json!("3.1.0");
    doc["info"] = json!({"title": "fragment", "version": "1"});
    doc["components"]["schemas"] = json!({"Problem": {"type": "object"}});
    let file = std::env::temp_dir().join(format!("idemkit-fragment-{}.json", std::process::id()));
    std::fs::write(&file, doc.to_string()).unwrap();
    let run = lint(file.to_str().unwrap(), &[]).await;
    let _ = std::fs::remove_file(&file);
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(notes(&run, "POST /labels").is_empty(), "{run:#?}");
    assert_eq!(
        verdicts(&run)["POST /labels"].1,
        json!({"in": "body", "name": "/idempotencyKey"})
    );
}
