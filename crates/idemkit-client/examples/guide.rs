//! A new user's program, written from `docs/client.md` alone: one retrying client, a
//! write with an event-derived key, a keyless write that gets an automatic key, and both
//! kinds of result handled (`Ok` for answers that are never retried, `Err` when
//! retries ran out).
//!
//! ```text
//! cargo run -p idemkit-client --example guide -- http://127.0.0.1:8080
//! ```

use std::time::Duration;

use idemkit_client::{IdempotencyKey, RetryConfig, RetryErrorExt, RetryMiddleware, RetryPolicy, Stop, wire};

/// Settings from the guide's table: a `Copy` value built in a `const`.
const ORDERS: RetryConfig = RetryConfig::new()
    .with_max_attempts(4)
    .with_deadline(Duration::from_secs(10))
    .with_attempt_timeout(Duration::from_secs(2))
    .with_retry_after_cap(Duration::from_secs(30))
    .with_name("orders");

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let base = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:8080".to_owned());

    // One policy per client: its retry budget is shared by every call made through it.
    let policy = RetryPolicy::new(ORDERS);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy.clone()))
        .build();

    // A key derived from the business event: the same confirmation always has the
    // same key, even after a restart.
    let order_id = 42;
    let confirm = client
        .post(format!("{base}/orders/{order_id}/confirm"))
        .header(
            wire::IDEMPOTENCY_KEY,
            IdempotencyKey::derived("order-confirm", order_id).as_str(),
        )
        .header("content-type", "application/json")
        .body(r#"{"confirm":true}"#)
        .send()
        .await;
    report("confirm order", confirm).await?;

    // No key: the PUT gets an automatic one, generated once and sent on every attempt.
    let update = client
        .put(format!("{base}/orders/{order_id}/address"))
        .header("content-type", "application/json")
        .body(r#"{"city":"Lyon"}"#)
        .send()
        .await;
    report("update address", update).await?;

    println!("retry budget left: {:?} tokens", policy.budget_remaining());
    Ok(())
}

/// Handles both kinds of result the guide describes.
async fn report(
    what: &str,
    result: Result<reqwest::Response, reqwest_middleware::Error>,
) -> Result<(), Box<dyn std::error::Error>> {
    match result {
        // Not retried, good or bad: a success, or e.g. 400 / 409 idempotency_key_reused.
        Ok(response) if response.status().is_success() => {
            println!("{what}: {} {}", response.status(), response.text().await?);
        }
        Ok(response) => {
            println!(
                "{what}: refused with {}: {}",
                response.status(),
                response.text().await?
            );
        }
        // Retried and gave up, or was not allowed to retry.
        Err(err) => match err.into_retry_error() {
            Ok(gave_up) => {
                println!(
                    "{what}: gave up after {} attempt(s): {}",
                    gave_up.attempts(),
                    gave_up.stop_reason()
                );
                match gave_up.stop_reason() {
                    Stop::RetryAfterAboveCap { retry_after }
                    | Stop::RetryAfterPastDeadline { retry_after } => {
                        println!("{what}: the server asked to come back in {retry_after:?}");
                    }
                    Stop::BudgetExhausted => println!("{what}: too many recent failures; backing off"),
                    _ => {}
                }
                if let Some(status) = gave_up.status() {
                    println!("{what}: last answer {status}");
                }
                if let Some(last) = gave_up.into_response() {
                    println!("{what}: last body {}", last.text().await?);
                }
            }
            // Never reached the retry layer (e.g. an invalid URL).
            Err(other) => println!("{what}: {other}"),
        },
    }
    Ok(())
}
