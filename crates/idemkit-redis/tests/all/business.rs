//! Business data in Redis, written with the phase advance in one fenced
//! script (`RedisStore::advance_with`): all or nothing, never by a stale
//! holder, only in the account's cluster slot. Run on a single node here and
//! on the real cluster by `cluster.rs`.

use std::sync::Arc;

use idemkit_core::{ClaimOutcome, KeyStore, PhaseUpdate, StoreError};
use idemkit_redis::{RedisStore, RedisWrite, WriteRefused};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{LEASE, claim_req, must_claim, scope};

use crate::common::{connect_single, redis_url, single_config};

/// The server(s) a test's store runs on, for commands the test sends itself.
pub(crate) enum Server {
    /// One node at this URL.
    Single(String),
    /// A cluster through these seed nodes.
    Cluster(Vec<String>),
}

impl Server {
    /// The shared single node of `IDEMKIT_TEST_REDIS_URL`.
    fn single() -> Self {
        Self::Single(redis_url().expect("redis url"))
    }
}

/// Runs `cmd` on the store's server (a cluster client when the store is one).
async fn query(server: &Server, cmd: &redis::Cmd) -> redis::Value {
    match server {
        Server::Cluster(urls) => {
            let client = redis::cluster::ClusterClient::new(urls.clone()).unwrap();
            let mut conn = client.get_async_connection().await.unwrap();
            cmd.query_async(&mut conn).await.unwrap()
        }
        Server::Single(url) => {
            let client = redis::Client::open(url.as_str()).unwrap();
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            cmd.query_async(&mut conn).await.unwrap()
        }
    }
}

async fn get(server: &Server, key: &str) -> Option<String> {
    match query(server, redis::cmd("GET").arg(key)).await {
        redis::Value::Nil => None,
        v => Some(redis::from_redis_value(v).unwrap()),
    }
}

async fn hget(server: &Server, key: &str, field: &str) -> Option<String> {
    match query(server, redis::cmd("HGET").arg(key).arg(field)).await {
        redis::Value::Nil => None,
        v => Some(redis::from_redis_value(v).unwrap()),
    }
}

fn update(point: &str) -> PhaseUpdate {
    PhaseUpdate {
        recovery_point: point.into(),
        step: Some((point.into(), serde_json::json!({ "at": point }))),
    }
}

/// The whole case, on any Redis deployment.
pub(crate) async fn business_writes_are_fenced_with_the_phase(
    server: Server,
    store: Arc<RedisStore>,
    clock: Arc<ManualClock>,
) {
    let s = scope("biz-account", "order-1");
    let order = store.business_key(&s.account, "order:1");
    let stock = store.business_key(&s.account, "stock:BOOK-1");
    let first = must_claim(&*store, &claim_req(&s, "body")).await;
    store
        .advance_with(
            &s,
            first.token,
            &update("reserved"),
            &[
                RedisWrite::hset(order.clone(), "status", "reserved"),
                RedisWrite::incr_by(stock.clone(), -1),
            ],
        )
        .await
        .expect("the phase and its writes");
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("reserved"));
    assert_eq!(hget(&server, &order, "status").await.as_deref(), Some("reserved"));
    assert_eq!(get(&server, &stock).await.as_deref(), Some("-1"));

    // A write that does not fit its key's type: nothing at all is written.
    let note = store.business_key(&s.account, "note");
    let refused = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[
                RedisWrite::set(note.clone(), "charged"),
                RedisWrite::incr_by(order.clone(), 1), // a hash, not a counter
            ],
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");
    assert_eq!(get(&server, &note).await, None, "no write of a refused advance");
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("reserved"));

    // A key outside the account's slot is refused before anything is sent.
    let foreign = store.business_key(&scope("another-account", "x").account, "stock:BOOK-1");
    let refused = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[RedisWrite::incr_by(foreign.clone(), -1)],
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");
    assert_eq!(get(&server, &foreign).await, None);
    let refused = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[RedisWrite::set("plain-key".into(), "x")],
        )
        .await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");

    // The lease lapses and a retry takes over: the stale holder's phase and
    // its writes are refused together.
    clock.advance(LEASE * 2);
    let ClaimOutcome::Claimed(second) = store.claim(&claim_req(&s, "body")).await.unwrap() else {
        panic!("the retry takes over")
    };
    assert_eq!(second.resumed_from.as_deref(), Some("reserved"));
    let stale = store
        .advance_with(
            &s,
            first.token,
            &update("charged"),
            &[
                RedisWrite::incr_by(stock.clone(), -1),
                RedisWrite::del(order.clone()),
            ],
        )
        .await;
    assert!(matches!(stale, Err(StoreError::Fenced)), "{stale:?}");
    assert_eq!(
        get(&server, &stock).await.as_deref(),
        Some("-1"),
        "the stale decrement never applied"
    );
    assert_eq!(hget(&server, &order, "status").await.as_deref(), Some("reserved"));
    // The new holder's own phase goes through.
    store
        .advance_with(
            &s,
            second.token,
            &update("charged"),
            &[
                RedisWrite::hset(order.clone(), "status", "charged"),
                RedisWrite::sadd(store.business_key(&s.account, "charged"), "order:1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(hget(&server, &order, "status").await.as_deref(), Some("charged"));
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("charged"));
    assert!(record.step_outputs.contains_key("charged"));
}

#[tokio::test]
async fn business_writes_on_a_single_node() {
    if redis_url().is_none() {
        return;
    }
    let clock = Arc::new(ManualClock::new());
    let store = connect_single(single_config("business"))
        .await
        .unwrap()
        .with_test_clock(clock.clone());
    business_writes_are_fenced_with_the_phase(Server::single(), Arc::new(store), clock).await;
}

/// Whether Redis runs `cmd` without an error (single node).
async fn accepted(cmd: &redis::Cmd) -> bool {
    let client = redis::Client::open(redis_url().expect("redis url").as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    cmd.query_async::<redis::Value>(&mut conn).await.is_ok()
}

/// `DUMP` of `key` (any type; `None` when absent): compares a key's whole
/// value before and after a refused advance.
async fn dump(server: &Server, key: &str) -> Option<Vec<u8>> {
    match query(server, redis::cmd("DUMP").arg(key)).await {
        redis::Value::Nil => None,
        v => Some(redis::from_redis_value(v).unwrap()),
    }
}

/// A `RedisWrite` built by hand, as a caller may (the fields are public):
/// `INCRBY key <operand>` with an operand `RedisWrite::incr_by` never makes.
fn raw_incr(key: &str, operand: &str) -> RedisWrite {
    RedisWrite {
        key: key.to_owned(),
        op: idemkit_redis::WriteOp::IncrBy,
        field: Vec::new(),
        value: operand.as_bytes().to_vec(),
    }
}

/// A record claimed and advanced to `start`, and a business key `stock` at 10.
struct Batch {
    server: Server,
    store: RedisStore,
    scope: idemkit_core::Scope,
    token: idemkit_core::FencingToken,
    stock: String,
}

impl Batch {
    async fn new(tag: &str) -> Self {
        let store = connect_single(single_config(tag)).await.unwrap();
        let scope = scope("batch-account", tag);
        let token = must_claim(&store, &claim_req(&scope, "body")).await.token;
        let stock = store.business_key(&scope.account, "stock");
        store
            .advance_with(
                &scope,
                token,
                &update("start"),
                &[RedisWrite::set(stock.clone(), "10")],
            )
            .await
            .unwrap();
        Self {
            server: Server::single(),
            store,
            scope,
            token,
            stock,
        }
    }

    fn key(&self, name: &str) -> String {
        self.store.business_key(&self.scope.account, name)
    }

    /// Advances to `next` with `INCRBY stock -1` followed by `rest`.
    async fn advance(&self, rest: Vec<RedisWrite>) -> idemkit_core::StoreResult<()> {
        let mut writes = vec![RedisWrite::incr_by(self.stock.clone(), -1)];
        writes.extend(rest);
        self.store
            .advance_with(&self.scope, self.token, &update("next"), &writes)
            .await
    }

    /// `INCRBY stock -1` then `rest` must be refused as a whole: the stock
    /// still 10, every key of `rest` as it was, the recovery point and the
    /// step outputs unmoved. A case that fails is noted in `failures` and its
    /// keys are put back, so every case is judged on its own.
    async fn refused(&self, failures: &mut Vec<String>, what: &str, rest: Vec<RedisWrite>) {
        let mut before = Vec::new();
        for w in &rest {
            before.push(dump(&self.server, &w.key).await);
        }
        let result = self.advance(rest.clone()).await;
        let mut wrong = Vec::new();
        let stock = get(&self.server, &self.stock).await;
        if stock.as_deref() != Some("10") {
            wrong.push(format!("the stock is {stock:?}, not \"10\""));
        }
        for (w, before) in rest.iter().zip(&before) {
            if dump(&self.server, &w.key).await != *before {
                wrong.push(format!("`{}` changed", w.key));
            }
        }
        let record = self.store.get(&self.scope).await.unwrap().unwrap();
        if record.recovery_point.as_deref() != Some("start") || record.step_outputs.contains_key("next") {
            wrong.push(format!("the phase moved to {:?}", record.recovery_point));
        }
        match &result {
            Err(StoreError::Backend(e))
                if e.downcast_ref::<WriteRefused>()
                    .is_some_and(|r| r.index > 0 && rest[r.index - 1].key == r.key) => {}
            other => wrong.push(format!("answered {other:?}")),
        }
        if !wrong.is_empty() {
            failures.push(format!("{what}: {}", wrong.join("; ")));
            // Put everything back for the next case.
            query(&self.server, redis::cmd("SET").arg(&self.stock).arg("10")).await;
            for (w, before) in rest.iter().zip(before) {
                query(&self.server, redis::cmd("DEL").arg(&w.key)).await;
                if let Some(d) = before {
                    query(&self.server, redis::cmd("RESTORE").arg(&w.key).arg(0).arg(d)).await;
                }
            }
            self.store
                .advance_with(&self.scope, self.token, &update("start"), &[])
                .await
                .unwrap();
            query(
                &self.server,
                redis::cmd("HDEL")
                    .arg(self.store.record_key(&self.scope))
                    .arg("step:next"),
            )
            .await;
        }
    }
}

/// A phase's batch is checked as a whole against the key space as the batch
/// itself would leave it, with Redis's own integer rules and 64-bit range, so
/// the script never fails after its first write: a refused batch writes
/// nothing (the stock stays at 10, the recovery point does not move), and a
/// takeover that re-runs the phase decrements once.
#[tokio::test]
async fn a_phase_batch_is_refused_whole_or_applied_whole() {
    if redis_url().is_none() {
        return;
    }
    let b = Batch::new("batch-refused").await;
    let mut failures = Vec::new();
    let order = b.key("order");

    // WRONGTYPE caused by the batch's own earlier write.
    b.refused(
        &mut failures,
        "HSET on a key the batch made a string",
        vec![
            RedisWrite::set(order.clone(), "x"),
            RedisWrite::hset(order.clone(), "status", "reserved"),
        ],
    )
    .await;
    b.refused(
        &mut failures,
        "INCRBY on a key the batch made a hash",
        vec![
            RedisWrite::hset(order.clone(), "status", "reserved"),
            RedisWrite::incr_by(order.clone(), 1),
        ],
    )
    .await;
    b.refused(
        &mut failures,
        "SADD on a key the batch made a hash",
        vec![
            RedisWrite::hset(order.clone(), "status", "reserved"),
            RedisWrite::sadd(order.clone(), "m"),
        ],
    )
    .await;
    b.refused(
        &mut failures,
        "INCRBY on the stock the batch made a set",
        vec![
            RedisWrite::del(b.stock.clone()),
            RedisWrite::sadd(b.stock.clone(), "m"),
            RedisWrite::incr_by(b.stock.clone(), 1),
        ],
    )
    .await;

    // Operands Lua's `tonumber` takes and Redis refuses.
    let counter = b.key("counter");
    for operand in [
        "1.5",
        "1e3",
        "+1",
        " 1",
        "1 ",
        "01",
        "-0",
        "-",
        "",
        "0x10",
        "9223372036854775808",
        "-9223372036854775809",
    ] {
        b.refused(
            &mut failures,
            &format!("INCRBY by {operand:?}"),
            vec![raw_incr(&counter, operand)],
        )
        .await;
    }
    // Current values that are not integers, including one the batch wrote.
    b.refused(
        &mut failures,
        "INCRBY of a value the batch set to 1e3",
        vec![
            RedisWrite::set(counter.clone(), "1e3"),
            RedisWrite::incr_by(counter.clone(), 1),
        ],
    )
    .await;
    query(&b.server, redis::cmd("SET").arg(&counter).arg("1.5")).await;
    b.refused(
        &mut failures,
        "INCRBY of a stored 1.5",
        vec![RedisWrite::incr_by(counter.clone(), 1)],
    )
    .await;

    // Overflow, stored or made by the batch; a double cannot tell
    // 9223372036854775806 from i64::MAX, so the range is checked exactly.
    let big = b.key("big");
    b.refused(
        &mut failures,
        "INCRBY past i64::MAX set by the batch",
        vec![
            RedisWrite::set(big.clone(), i64::MAX.to_string()),
            RedisWrite::incr_by(big.clone(), 1),
        ],
    )
    .await;
    query(&b.server, redis::cmd("SET").arg(&big).arg(i64::MAX)).await;
    b.refused(
        &mut failures,
        "INCRBY past a stored i64::MAX",
        vec![RedisWrite::incr_by(big.clone(), 1)],
    )
    .await;
    b.refused(
        &mut failures,
        "two INCRBYs, the second past i64::MAX",
        vec![
            RedisWrite::set(big.clone(), (i64::MAX - 1).to_string()),
            RedisWrite::incr_by(big.clone(), 1),
            RedisWrite::incr_by(big.clone(), 1),
        ],
    )
    .await;
    query(&b.server, redis::cmd("SET").arg(&big).arg(i64::MIN)).await;
    b.refused(
        &mut failures,
        "INCRBY below a stored i64::MIN",
        vec![RedisWrite::incr_by(big.clone(), -1)],
    )
    .await;
    b.refused(
        &mut failures,
        "INCRBY by i64::MIN of a negative value",
        vec![
            RedisWrite::set(big.clone(), "-1"),
            RedisWrite::incr_by(big.clone(), i64::MIN),
        ],
    )
    .await;
    assert!(
        failures.is_empty(),
        "{} batches were not refused whole:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The simulation refuses no batch Redis would run: a key the batch deletes
/// takes any type afterwards, counters start at 0, values the batch sets are
/// counted from, and the 64-bit edges are reached exactly.
#[tokio::test]
async fn a_phase_batch_redis_would_run_is_applied() {
    if redis_url().is_none() {
        return;
    }
    let b = Batch::new("batch-applied").await;
    let (x, c, big) = (b.key("x"), b.key("c"), b.key("big"));
    query(&b.server, redis::cmd("SET").arg(&big).arg(i64::MAX - 2)).await;
    b.advance(vec![
        RedisWrite::set(x.clone(), "a"),
        RedisWrite::del(x.clone()),
        RedisWrite::hset(x.clone(), "f", "v"),
        RedisWrite::incr_by(c.clone(), 7),
        RedisWrite::set(c.clone(), "-9007199254740993"),
        RedisWrite::incr_by(c.clone(), -2),
        RedisWrite::incr_by(big.clone(), 1),
        RedisWrite::incr_by(big.clone(), 1),
    ])
    .await
    .expect("a batch Redis runs");
    assert_eq!(get(&b.server, &b.stock).await.as_deref(), Some("9"));
    assert_eq!(hget(&b.server, &x, "f").await.as_deref(), Some("v"));
    assert_eq!(get(&b.server, &c).await.as_deref(), Some("-9007199254740995"));
    assert_eq!(get(&b.server, &big).await, Some(i64::MAX.to_string()));
    let record = b.store.get(&b.scope).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("next"));

    let low = b.key("low");
    b.store
        .advance_with(
            &b.scope,
            b.token,
            &update("low"),
            &[RedisWrite::incr_by(low.clone(), i64::MIN), raw_incr(&low, "0")],
        )
        .await
        .expect("i64::MIN is in range");
    assert_eq!(get(&b.server, &low).await, Some(i64::MIN.to_string()));
}

/// The check parses integers as Redis does: for each operand, and for each
/// stored value, the batch (`INCRBY stock -1` first) is applied exactly when
/// a plain `INCRBY` of Redis accepts it, and refused by the check (nothing
/// written, the stock still 10) otherwise.
#[tokio::test]
async fn the_phase_check_parses_integers_as_redis_does() {
    if redis_url().is_none() {
        return;
    }
    let b = Batch::new("batch-parse").await;
    let probe = b.key("probe");
    let candidates = [
        "0",
        "7",
        "-7",
        "10",
        "-0",
        "00",
        "01",
        "-01",
        "+1",
        " 1",
        "1 ",
        "\t1",
        "1\n",
        "1\0",
        "1.5",
        "1.0",
        "1e3",
        "0x10",
        "inf",
        "nan",
        "-",
        "",
        "--1",
        "1-",
        "\u{661}",
        "9007199254740993",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775807",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551616",
        "00000000000000000001",
        "123456789012345678901",
    ];
    let mut failures = Vec::new();
    for (i, s) in candidates.iter().enumerate() {
        // As the operand (on an absent key), then as the stored value (incremented by 0).
        query(&b.server, redis::cmd("DEL").arg(&probe)).await;
        let as_operand = accepted(redis::cmd("INCRBY").arg(&probe).arg(*s)).await;
        query(&b.server, redis::cmd("SET").arg(&probe).arg(*s)).await;
        let as_stored = accepted(redis::cmd("INCRBY").arg(&probe).arg(0)).await;
        let stored = b.key(&format!("stored-{i}"));
        query(&b.server, redis::cmd("SET").arg(&stored).arg(*s)).await;
        for (what, redis_takes, write) in [
            (
                "operand",
                as_operand,
                raw_incr(&b.key(&format!("operand-{i}")), s),
            ),
            ("stored value", as_stored, RedisWrite::incr_by(stored.clone(), 0)),
        ] {
            let ours = b.advance(vec![write]).await;
            let stock = get(&b.server, &b.stock).await;
            let fine = match &ours {
                Ok(()) => redis_takes && stock.as_deref() == Some("9"),
                Err(StoreError::Backend(e)) => {
                    !redis_takes
                        && e.downcast_ref::<WriteRefused>().is_some_and(|r| r.index == 1)
                        && stock.as_deref() == Some("10")
                }
                Err(_) => false,
            };
            if !fine {
                failures.push(format!(
                    "{what} {s:?}: Redis {}, the phase answered {ours:?}, the stock is {stock:?}",
                    if redis_takes { "takes it" } else { "refuses it" }
                ));
            }
            query(&b.server, redis::cmd("SET").arg(&b.stock).arg("10")).await;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
