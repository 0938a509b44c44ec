//! A single-step request that stores no answer (the handler answered a
//! validation-class 4xx, or its answer is over the storage cap) has its
//! transaction rolled back through the store before the answer leaves, so
//! what the transaction held (on PostgreSQL the key's lock, on SQLite the
//! write lock) is free when a retry sent on that answer arrives. Dropping the
//! transaction would roll it back too, but later, in a task of its own. That
//! each store's `rollback_tx` frees its locks before returning is the stores'
//! test (`rollback_tx_frees_the_keys_lock_before_returning` on PostgreSQL).

use super::*;
use idemkit_testkit::Probed;

#[tokio::test]
async fn a_single_step_request_that_stores_nothing_is_rolled_back_before_answering() {
    let store = Arc::new(Probed::new(
        Arc::try_unwrap(sqlite(None).await).expect("the only handle"),
    ));
    let layer = IdempotencyLayer::single_step(store.clone(), BearerTokenAccount::new("test-secret"))
        .policy(Policy::new().with_max_stored_body(16))
        .build()
        .unwrap();
    let app = Router::new().route(
        "/op",
        post(
            |ctx: IdempotencyContext, mut tx: Tx<SqliteTx>, Json(body): Json<Value>| async move {
                sqlx::query("INSERT INTO rows (account, n) VALUES (?1, 1)")
                    .bind(ctx.scope.account.as_str().to_owned())
                    .execute(&mut **tx)
                    .await
                    .unwrap();
                match body["answer"].as_str() {
                    Some("invalid") => (StatusCode::UNPROCESSABLE_ENTITY, String::new()),
                    Some("huge") => (StatusCode::CREATED, "x".repeat(17)),
                    _ => (StatusCode::CREATED, "ok".to_owned()),
                }
            },
        )
        .layer(layer),
    );
    let base = serve(app).await;

    let invalid = send(&base, Some("k"), "a", &json!({"answer": "invalid"})).await;
    assert_eq!(invalid.status, 422);
    assert_eq!(store.rollbacks(), 1, "released: rolled back before the answer");
    let huge = send(&base, Some("k"), "a", &json!({"answer": "huge"})).await;
    assert_eq!(huge.code(), "idempotency_response_too_large");
    assert_eq!(store.rollbacks(), 2, "unstorable: rolled back before the answer");
    let ok = send(&base, Some("k"), "a", &json!({})).await;
    assert_eq!(ok.status, 201, "the key was free each time");
    assert_eq!(store.rollbacks(), 2, "a committed request is not rolled back");
    assert_eq!(rows(store.inner()).await, 1, "only the committed request's write");
}
