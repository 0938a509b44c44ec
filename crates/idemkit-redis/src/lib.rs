//! # idemkit-redis
//!
//! A [`KeyStore`](idemkit_core::KeyStore) on Redis or Valkey, for teams whose only shared store is Redis.
//! Claim, takeover, heartbeat, phase advance, completion, release, abandon,
//! park and the operator's releases are each **one Lua script** (one round
//! trip) that Redis runs atomically. Every record carries a **fencing token**
//! that moves on every new holder (first attempt, takeover, reuse after release
//! or after the replay window) and on abandon, park and release; every
//! lease-holder write compares it and is refused with [`StoreError::Fenced`]
//! when it is stale. Tokens come from a per-account high-water mark that
//! outlives every record, so a key deleted by the reaper or by its TTL never
//! restarts at 1. The reaper, the review list, the completer's work list and
//! operator listings walk the keyspace with `SCAN` (per primary on a cluster)
//! and read or change it in bounded batches, one script per batch. A plain `SET NX` + TTL lease is not a
//! claim: a client paused past its lease would still write after the owner changed.
//!
//! ```no_run
//! use std::sync::Arc;
//! use idemkit_core::KeyStore;
//! use idemkit_redis::{RedisConfig, RedisStore};
//!
//! # async fn demo() -> Result<(), idemkit_core::StoreError> {
//! let store = RedisStore::connect_with("redis://127.0.0.1:6379", RedisConfig::default().with_prefix("shop")).await?;
//! let keys: Arc<dyn KeyStore> = Arc::new(store);
//! # let _ = keys; Ok(()) }
//! ```
//!
//! What this buys is *effectively once within the key scope and replay window*,
//! and only as durable as the Redis deployment: see the guide's Redis page (`docs/redis.md`) for
//! `appendfsync`, `WAIT`, Redis Cluster and the key layout.
//!
//! Business writes do not live in Redis, so there is no single-step
//! transactional mode ([`idemkit_core::TransactionalStore`] is not implemented):
//! the layer's generic lease mode is used, with fenced phases for multi-step work.

mod business;
mod config;
mod conn;
mod decode;
mod error;
mod keys;
mod notify;
mod scripts;
mod store;
mod write;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use idemkit_core::{
    ClaimOutcome, ClaimRequest, Clock, FORCE_RELEASED, FencingToken, Millis, RELEASE_REFUSED, Record, Scope,
    StoreError, StoreResult, SystemClock,
};
use redis::{Cmd, Value};

pub use config::{DEFAULT_PREFIX, DEFAULT_REAP_AFTER, RedisConfig};
pub use error::{OperationTimedOut, RedisConfigError, ReplicaShortfall, WriteRefused};
pub use write::{RedisWrite, WriteOp};

use conn::Conn;
use decode::{bytes_of, decode_claim, decode_record, to_json};
use error::{corrupt, map_err};
use notify::Notifier;
use scripts::{Lua, SCRIPTS};

/// A [`KeyStore`](idemkit_core::KeyStore) on Redis (single node or Redis Cluster). Cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    // Independent multiplexed connections, used round-robin: a blocking `WAIT`
    // holds up only the requests queued behind it on its own connection.
    conns: Arc<[Conn]>,
    next: Arc<AtomicUsize>,
    config: Arc<RedisConfig>,
    clock: Arc<dyn Clock>,
    test_clock: Option<Arc<dyn Clock>>,
    notifier: Option<Arc<Notifier>>,
    publish: &'static str,
    ids: Arc<WriteIds>,
}

/// Unique ids for claims and fenced writes: a random per-store part (so stores in
/// different processes or hosts never collide) and a counter.
#[derive(Debug)]
struct WriteIds {
    seed: u64,
    counter: AtomicU64,
}

impl WriteIds {
    fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        // `RandomState` is seeded from the OS's randomness.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.write_u32(std::process::id());
        Self {
            seed: h.finish(),
            counter: AtomicU64::new(0),
        }
    }

    fn next(&self) -> String {
        format!(
            "{:016x}-{:x}",
            self.seed,
            self.counter.fetch_add(1, Ordering::Relaxed)
        )
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("mode", &self.conns[0])
            .field("connections", &self.conns.len())
            .field("key_prefix", &self.config.key_prefix)
            .field("wait_replicas", &self.config.wait_replicas)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects with the default settings to the single node at `url`
    /// (`redis://host:port[/db]`, also `rediss://` and `redis+unix://`), or to
    /// a cluster through its seed nodes (`redis+cluster://host:port,host:port`),
    /// and loads the scripts. Fails with [`StoreError::Unavailable`] when the
    /// server cannot be reached.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, RedisConfig::default()).await
    }

    /// [`RedisStore::connect`] with these settings.
    pub async fn connect_with(url: &str, config: RedisConfig) -> StoreResult<Self> {
        let endpoint = config::Endpoint::parse(url)?;
        config.validate()?;
        let config = RedisConfig {
            urls: endpoint.urls,
            cluster: endpoint.cluster,
            ..config
        };
        let budget = config.op_budget();
        let mut conns = Vec::new();
        for _ in 0..config.connection_count() {
            let conn = tokio::time::timeout(budget, Conn::connect(&config))
                .await
                .map_err(|_| StoreError::Unavailable(Box::new(OperationTimedOut(budget))))?
                .map_err(map_err)?;
            conns.push(conn);
        }
        // Only an optimisation (a missing script falls back to EVAL), so failures
        // are not fatal.
        if let Err(e) = conns[0].preload(&SCRIPTS.all()).await {
            tracing::debug!(error = %e, "idemkit-redis: could not preload scripts");
        }
        let publish = Notifier::publish_command(&config);
        let notifier = config
            .notifications
            .then(|| Arc::new(Notifier::new(config.clone())));
        Ok(Self {
            conns: conns.into(),
            next: Arc::default(),
            config: Arc::new(config),
            clock: Arc::new(SystemClock),
            test_clock: None,
            notifier,
            publish,
            ids: Arc::new(WriteIds::new()),
        })
    }

    /// Replaces the application clock, which only [`KeyStore::now`](idemkit_core::KeyStore::now) reads
    /// (coarse cutoffs). The scripts judge leases and windows by the server's
    /// `TIME` whatever this clock says, so instances whose clocks disagree still
    /// agree on who holds a key.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Replaces the server's clock, in every script this handle runs, with
    /// `clock` (and the application clock too). For tests that move time by
    /// hand; never in production, where instances must share one clock. A
    /// test hook behind the `testing` feature, outside the semver promise.
    #[cfg(feature = "testing")]
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock.clone();
        self.test_clock = Some(clock);
        self
    }

    /// Deletes every key under this handle's prefix (records, review list,
    /// token marks), for a test or bench that made the prefix its own. A test
    /// hook behind the `testing` feature, outside the semver promise.
    #[cfg(feature = "testing")]
    pub async fn clear_prefix(&self) -> StoreResult<()> {
        let mut pattern = String::new();
        keys::push_glob_literal(&self.config.key_prefix, &mut pattern);
        pattern.push('*');
        let names = self.scan_all(&pattern).await?;
        for batch in self.batches(names) {
            let mut cmd = redis::cmd("UNLINK");
            cmd.arg(&batch);
            self.conn().query(&cmd).await.map_err(map_err)?;
        }
        Ok(())
    }

    /// The same connections under another key prefix: a separate store in
    /// effect (records, review list, token marks), without new connections.
    /// Refused like [`RedisConfig::validate`] refuses a bad prefix.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Result<Self, RedisConfigError> {
        let config = RedisConfig {
            key_prefix: prefix.into(),
            ..(*self.config).clone()
        };
        config.validate()?;
        self.config = Arc::new(config);
        Ok(self)
    }

    /// The "now" argument of the scripts: the test clock's time, or empty for
    /// the server's `TIME`.
    fn now_arg(&self) -> String {
        self.test_clock
            .as_ref()
            .map_or_else(String::new, |c| c.now().0.to_string())
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The Redis key of the record of `scope` (a hash), for operators and tests.
    pub fn record_key(&self, scope: &Scope) -> String {
        keys::record_key(&self.config.key_prefix, scope)
    }

    fn conn(&self) -> &Conn {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        &self.conns[i % self.conns.len()]
    }

    /// Runs a script within the operation budget; the reply and `WAIT`'s count.
    async fn run(
        &self,
        lua: &Lua,
        keys: &[&str],
        fill: &(dyn Fn(&mut Cmd) + Send + Sync),
        wait: Option<(u32, Duration)>,
    ) -> StoreResult<(Value, Option<i64>)> {
        let budget = self.config.op_budget();
        tokio::time::timeout(budget, self.conn().eval(lua, keys, fill, wait))
            .await
            .map_err(|_| StoreError::Unavailable(Box::new(OperationTimedOut(budget))))?
            .map_err(map_err)
    }

    /// [`Self::run`] for a script that is safe to deliver twice (a claim under
    /// its attempt id, a fenced write under its write id: the second delivery
    /// answers like the first and writes nothing). A failure as unavailable (a
    /// connection that broke after sending, the operation timeout) may have hidden
    /// a script that ran: it is delivered once more, on the next connection, so
    /// the caller learns what happened instead of an error after a write that
    /// landed. One re-delivery, not a loop: a server that is really gone is a 503
    /// after two operation timeouts.
    async fn run_redelivered(
        &self,
        lua: &Lua,
        keys: &[&str],
        fill: &(dyn Fn(&mut Cmd) + Send + Sync),
        wait: Option<(u32, Duration)>,
    ) -> StoreResult<(Value, Option<i64>)> {
        match self.run(lua, keys, fill, wait).await {
            Err(StoreError::Unavailable(e)) => {
                tracing::debug!(error = %e, script = lua.name, "idemkit-redis: reply lost; delivering again");
                self.run(lua, keys, fill, wait).await
            }
            other => other,
        }
    }

    /// `Err(Unavailable)` when `WAIT` counted fewer replicas than required.
    fn check_acks(&self, acks: Option<i64>) -> StoreResult<()> {
        match (self.config.wait_replicas, acks) {
            (Some((required, timeout)), Some(n)) if n < i64::from(required) => {
                Err(StoreError::Unavailable(Box::new(ReplicaShortfall {
                    acknowledged: u32::try_from(n).unwrap_or(0),
                    required,
                    timeout,
                })))
            }
            _ => Ok(()),
        }
    }

    /// A lease-holder write: the script's guard refuses a stale token (reply 0).
    async fn fenced(
        &self,
        lua: &Lua,
        scope: &Scope,
        token: FencingToken,
        fill: &(dyn Fn(&mut Cmd) + Send + Sync),
    ) -> StoreResult<()> {
        self.fenced_with(
            lua,
            scope,
            token,
            fill,
            self.config.wait_replicas,
            &self.ids.next(),
        )
        .await
    }

    async fn fenced_with(
        &self,
        lua: &Lua,
        scope: &Scope,
        token: FencingToken,
        fill: &(dyn Fn(&mut Cmd) + Send + Sync),
        wait: Option<(u32, Duration)>,
        write_id: &str,
    ) -> StoreResult<()> {
        let key = self.record_key(scope);
        let channel = keys::channel(&self.config.key_prefix, scope);
        let tokens = keys::token_key(&self.config.key_prefix, scope);
        let (reply, acks) = self
            .run_redelivered(
                lua,
                &[&key, &channel, &tokens],
                &|c| {
                    c.arg(token.0);
                    fill(c);
                    c.arg(write_id);
                },
                wait,
            )
            .await?;
        match reply {
            Value::Int(1) => self.check_acks(acks),
            Value::Int(0) => Err(StoreError::Fenced),
            other => Err(corrupt(format!("{} script returned {other:?}", lua.name))),
        }
    }

    /// Every name matching `pattern` on every primary, page by page (`SCAN`,
    /// never `KEYS`: the server answers other clients between pages), each
    /// name once.
    async fn scan_all(&self, pattern: &str) -> StoreResult<Vec<String>> {
        let conn = self.conn();
        let budget = self.config.op_budget();
        let targets = tokio::time::timeout(budget, conn.scan_targets())
            .await
            .map_err(|_| StoreError::Unavailable(Box::new(OperationTimedOut(budget))))?
            .map_err(map_err)?;
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for target in targets {
            let mut cursor = 0;
            loop {
                let (next, names) =
                    tokio::time::timeout(budget, conn.scan_page(target, cursor, pattern, SCAN_COUNT))
                        .await
                        .map_err(|_| StoreError::Unavailable(Box::new(OperationTimedOut(budget))))?
                        .map_err(map_err)?;
                for name in names {
                    if seen.insert(name.clone()) {
                        out.push(name);
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    /// `names` in batches a script may touch: at most [`SCRIPT_BATCH`] names,
    /// and on a cluster, one account (one slot) per batch.
    fn batches(&self, mut names: Vec<String>) -> Vec<Vec<String>> {
        if self.conns[0].is_cluster() {
            let mut by_tag: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for name in names {
                by_tag.entry(keys::tag(&name).to_owned()).or_default().push(name);
            }
            by_tag
                .into_values()
                .flat_map(|group| {
                    group
                        .chunks(SCRIPT_BATCH)
                        .map(<[String]>::to_vec)
                        .collect::<Vec<_>>()
                })
                .collect()
        } else {
            names.sort();
            names.chunks(SCRIPT_BATCH).map(<[String]>::to_vec).collect()
        }
    }

    /// The hashes among `names` that pass the fetch script's filter (see
    /// `scripts::FETCH`), with their fields.
    async fn fetch(
        &self,
        names: Vec<String>,
        mode: &str,
        state: &str,
        claimed_before: Millis,
    ) -> StoreResult<Vec<(String, HashMap<String, Vec<u8>>)>> {
        let now = self.now_arg();
        let mut out = Vec::new();
        for batch in self.batches(names) {
            let refs: Vec<&str> = batch.iter().map(String::as_str).collect();
            let (reply, _) = self
                .run(
                    &SCRIPTS.fetch,
                    &refs,
                    &|c| {
                        c.arg(mode).arg(state).arg(&now).arg(claimed_before.0);
                    },
                    None,
                )
                .await?;
            let Value::Array(items) = reply else {
                return Err(corrupt(format!("fetch script returned {reply:?}")));
            };
            let mut items = items.into_iter();
            while let (Some(name), Some(fields)) = (items.next(), items.next()) {
                let name = bytes_of(name)
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(|| corrupt("fetch script returned a bad name"))?;
                let fields: HashMap<String, Vec<u8>> =
                    redis::from_redis_value(fields).map_err(|e| corrupt(e.to_string()))?;
                out.push((name, fields));
            }
        }
        Ok(out)
    }

    /// Whole records among `names` passing the filter, decoded.
    async fn fetch_records(
        &self,
        names: Vec<String>,
        mode: &str,
        state: &str,
        claimed_before: Millis,
    ) -> StoreResult<Vec<Record>> {
        let prefix = &self.config.key_prefix;
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| keys::parse(prefix, "k", n).is_some())
            .collect();
        let mut out = Vec::new();
        for (name, fields) in self.fetch(names, mode, state, claimed_before).await? {
            let scope =
                keys::parse(prefix, "k", &name).ok_or_else(|| corrupt(format!("record name {name}")))?;
            out.push(decode_record(&scope, fields)?);
        }
        Ok(out)
    }

    /// The holder's release, discarding recorded progress first when `discard`
    /// (see [`KeyStore::release`](idemkit_core::KeyStore::release) and [`KeyStore::release_discarding`](idemkit_core::KeyStore::release_discarding)).
    async fn release_with(&self, scope: &Scope, token: FencingToken, discard: bool) -> StoreResult<()> {
        let now = self.now_arg();
        let discard = if discard { "1" } else { "0" };
        self.fenced(&SCRIPTS.release, scope, token, &|c| {
            c.arg(self.publish).arg(&now).arg(RELEASE_REFUSED).arg(discard);
        })
        .await
    }

    /// An operator's release (see [`KeyStore::force_release`](idemkit_core::KeyStore::force_release) and
    /// [`KeyStore::discard_progress`](idemkit_core::KeyStore::discard_progress)): one script, guarded by the state.
    async fn operator_release(&self, scope: &Scope, discard: bool) -> StoreResult<bool> {
        let now = self.now_arg();
        let key = self.record_key(scope);
        let channel = keys::channel(&self.config.key_prefix, scope);
        let tokens = keys::token_key(&self.config.key_prefix, scope);
        let keep = ms(self.config.reap_after);
        let publish = self.publish;
        let (reply, acks) = self
            .run(
                &SCRIPTS.force_release,
                &[&key, &channel, &tokens],
                &|c| {
                    c.arg(&now)
                        .arg(FORCE_RELEASED)
                        .arg(publish)
                        .arg(if discard { "1" } else { "0" })
                        .arg(keep);
                },
                self.config.wait_replicas,
            )
            .await?;
        match reply {
            Value::Int(1) => self.check_acks(acks).map(|()| true),
            Value::Int(0) => Ok(false),
            other => Err(corrupt(format!("force_release script returned {other:?}"))),
        }
    }

    /// The claim, with the attempt id that makes its re-delivery harmless.
    async fn claim_as(&self, req: &ClaimRequest, attempt: &str) -> StoreResult<ClaimOutcome> {
        let now = self.now_arg();
        let expires = self.clock.now().plus(req.lease);
        let keep = self.config.reap_after.max(req.replay_window);
        let resume = req.resume.map_or_else(String::new, |t| t.0.to_string());
        let key = self.record_key(&req.scope);
        let tokens = keys::token_key(&self.config.key_prefix, &req.scope);
        let headers = to_json(&req.request.headers)?;
        let touch = if self.config.wait_replicas.is_some() {
            "1"
        } else {
            "0"
        };
        let fill = |c: &mut Cmd| {
            c.arg(&now)
                .arg(ms(req.lease))
                .arg(ms(req.replay_window))
                .arg(ms(keep))
                .arg(&req.fingerprint.as_bytes()[..])
                .arg(&req.request.method)
                .arg(&req.request.path)
                .arg(&headers)
                .arg(&req.request.body)
                .arg(touch)
                .arg(attempt)
                .arg(&resume)
                .arg(req.recovery_point.as_deref().unwrap_or_default());
        };
        let keys = [key.as_str(), tokens.as_str()];
        // A claim whose reply is lost is delivered again under the same attempt
        // id: the script answers its own attempt `Claimed` on the lease it took,
        // or, if the first delivery never ran, decides afresh; either way the
        // caller learns whether it holds the key, instead of an error while its
        // attempt holds it for a whole lease. (A late first delivery arriving
        // after the second finds its attempt and writes nothing.)
        let (reply, acks) = self
            .run_redelivered(&SCRIPTS.claim, &keys, &fill, self.config.wait_replicas)
            .await?;
        let outcome = decode_claim(reply, expires)?;
        if matches!(outcome, ClaimOutcome::Claimed(_) | ClaimOutcome::Replay(_))
            && let Err(e) = self.check_acks(acks)
        {
            if let ClaimOutcome::Claimed(lease) = &outcome {
                // Nothing ran under this claim: hand the key back so the retry need
                // not wait out the lease. Best effort and without `WAIT` (the
                // replicas are what is missing); the lease expires anyway.
                let publish = self.publish;
                let now = self.now_arg();
                let _ = self
                    .fenced_with(
                        &SCRIPTS.release,
                        &req.scope,
                        lease.token,
                        &|c| {
                            // Nothing ran under this claim. A new request's record holds
                            // only what its claim wrote (the recovery point it starts
                            // at): discarded. A takeover keeps the earlier attempts'
                            // progress (a release with progress abandons instead).
                            let discard = if lease.resumed_from.is_none() { "1" } else { "0" };
                            c.arg(publish).arg(&now).arg(RELEASE_REFUSED).arg(discard);
                        },
                        None,
                        &self.ids.next(),
                    )
                    .await;
            }
            return Err(e);
        }
        Ok(outcome)
    }
}

/// `SCAN … COUNT`: how much of the keyspace one page looks at.
const SCAN_COUNT: usize = 500;

/// The most keys one operator or reaper script touches, so no script holds
/// the server for long.
const SCRIPT_BATCH: usize = 100;

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemkit_core::{Account, IdempotencyKey, KeyStore, StoredResponse};

    /// A store on the test server under a fresh prefix; `None` (with a notice)
    /// when `IDEMKIT_TEST_REDIS_URL` is unset, a failure under `CI`.
    async fn test_store() -> Option<RedisStore> {
        let url = match std::env::var("IDEMKIT_TEST_REDIS_URL") {
            Ok(url) => url,
            Err(_) if std::env::var_os("CI").is_some() => {
                panic!("IDEMKIT_TEST_REDIS_URL is not set under CI")
            }
            Err(_) => {
                eprintln!("notice: IDEMKIT_TEST_REDIS_URL is not set; skipping");
                return None;
            }
        };
        let prefix = format!("idemkit-unit:{}:{}", std::process::id(), WriteIds::new().next());
        Some(
            RedisStore::connect_with(&url, RedisConfig::default().with_prefix(prefix))
                .await
                .unwrap(),
        )
    }

    /// A reply lost on the way back makes the client send the same command
    /// again; the second delivery must answer like the first.
    #[tokio::test]
    async fn redelivered_claims_and_writes_answer_like_the_first_delivery() {
        let Some(store) = test_store().await else { return };
        let scope = Scope::new(Account::new("a"), IdempotencyKey::parse("k").unwrap());
        let req = idemkit_testkit::suite::claim_req(&scope, "{}");
        let first = store.claim_as(&req, "attempt-1").await.unwrap();
        let again = store.claim_as(&req, "attempt-1").await.unwrap();
        assert_eq!(first, again, "re-delivered claim");
        assert!(matches!(
            store.claim_as(&req, "attempt-2").await.unwrap(),
            ClaimOutcome::InProgress { .. }
        ));
        let ClaimOutcome::Claimed(lease) = first else {
            panic!("{first:?}")
        };
        let resp = StoredResponse {
            status: 201,
            ..Default::default()
        };
        let publish = store.publish;
        let complete = |id: &'static str| {
            let (store, scope, resp) = (store.clone(), scope.clone(), resp.clone());
            async move {
                let headers = to_json(&resp.headers).unwrap();
                store
                    .fenced_with(
                        &SCRIPTS.complete,
                        &scope,
                        lease.token,
                        &|c| {
                            c.arg(1)
                                .arg(resp.status)
                                .arg(&headers)
                                .arg(&resp.body)
                                .arg(publish);
                        },
                        None,
                        id,
                    )
                    .await
            }
        };
        complete("write-1").await.unwrap();
        complete("write-1")
            .await
            .expect("re-delivered completion succeeds");
        assert!(matches!(complete("write-2").await, Err(StoreError::Fenced)));
    }

    /// A claim that starts at a recovery point, delivered twice, resumes from
    /// what its first delivery resumed from: nothing for a new request (not the
    /// point the claim itself wrote), the record's point for a takeover.
    #[tokio::test]
    async fn redelivered_claims_resume_like_the_first_delivery() {
        let Some(store) = test_store().await else { return };
        let scope = Scope::new(Account::new("a"), IdempotencyKey::parse("starts-at").unwrap());
        let req = ClaimRequest {
            lease: Duration::from_millis(100),
            recovery_point: Some("forwarded".into()),
            ..idemkit_testkit::suite::claim_req(&scope, "{}")
        };
        let resumed = |o: ClaimOutcome| match o {
            ClaimOutcome::Claimed(lease) => lease.resumed_from,
            other => panic!("{other:?}"),
        };
        let first = resumed(store.claim_as(&req, "attempt-1").await.unwrap());
        assert_eq!(first, None, "a new request");
        assert_eq!(resumed(store.claim_as(&req, "attempt-1").await.unwrap()), None);
        tokio::time::sleep(Duration::from_millis(150)).await;
        for _ in 0..2 {
            assert_eq!(
                resumed(store.claim_as(&req, "attempt-2").await.unwrap()).as_deref(),
                Some("forwarded"),
                "the takeover, delivered twice"
            );
        }
    }

    /// `GET key` on the store's server.
    async fn get_str(store: &RedisStore, key: &str) -> Option<String> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        redis::from_redis_value(store.conn().query(&cmd).await.unwrap()).unwrap()
    }

    fn phase(point: &str) -> idemkit_core::PhaseUpdate {
        idemkit_core::PhaseUpdate {
            recovery_point: point.into(),
            step: None,
        }
    }

    /// Runs one fenced script under the write id `id`, as one delivery of it.
    async fn deliver(
        store: &RedisStore,
        lua: &Lua,
        scope: &Scope,
        token: FencingToken,
        fill: &(dyn Fn(&mut Cmd) + Send + Sync),
        id: &str,
    ) -> StoreResult<()> {
        store.fenced_with(lua, scope, token, fill, None, id).await
    }

    fn heartbeat_args(c: &mut Cmd) {
        c.arg("").arg(30_000);
    }

    /// The claim's lease, claimed under `attempt`.
    async fn claimed(store: &RedisStore, scope: &Scope, attempt: &str) -> idemkit_core::Lease {
        let req = idemkit_testkit::suite::claim_req(scope, "{}");
        match store.claim_as(&req, attempt).await.unwrap() {
            ClaimOutcome::Claimed(lease) => lease,
            other => panic!("{other:?}"),
        }
    }

    /// `PHASE(W1)` applies and its reply is lost, `HEARTBEAT(W2)` runs, the
    /// client sends `PHASE(W1)` again: answered as applied, not applied twice.
    /// The same after a later phase of the same holder.
    #[tokio::test]
    async fn a_resent_phase_is_recognised_whatever_ran_in_between() {
        let Some(store) = test_store().await else { return };
        let scope = Scope::new(Account::new("a"), IdempotencyKey::parse("resent-phase").unwrap());
        let lease = claimed(&store, &scope, "attempt-1").await;
        let stock = store.business_key(&scope.account, "stock");
        let mut set = redis::cmd("SET");
        set.arg(&stock).arg(10);
        store.conn().query(&set).await.unwrap();
        let decrement = [RedisWrite::incr_by(stock.clone(), -1)];

        store
            .advance_as(&scope, lease.token, &phase("reserved"), &decrement, "W1")
            .await
            .unwrap();
        assert_eq!(get_str(&store, &stock).await.as_deref(), Some("9"));
        // The reply of W1 is lost; the heartbeat task runs meanwhile.
        deliver(
            &store,
            &SCRIPTS.heartbeat,
            &scope,
            lease.token,
            &heartbeat_args,
            "W2",
        )
        .await
        .unwrap();
        store
            .advance_as(&scope, lease.token, &phase("reserved"), &decrement, "W1")
            .await
            .expect("the re-sent phase is answered as applied");
        assert_eq!(
            get_str(&store, &stock).await.as_deref(),
            Some("9"),
            "the re-sent phase was applied again after a heartbeat"
        );

        // A later phase, then a late copy of W1 (and of W2).
        store
            .advance_as(&scope, lease.token, &phase("charged"), &decrement, "W3")
            .await
            .unwrap();
        assert_eq!(get_str(&store, &stock).await.as_deref(), Some("8"));
        store
            .advance_as(&scope, lease.token, &phase("reserved"), &decrement, "W1")
            .await
            .unwrap();
        deliver(
            &store,
            &SCRIPTS.heartbeat,
            &scope,
            lease.token,
            &heartbeat_args,
            "W2",
        )
        .await
        .unwrap();
        assert_eq!(
            get_str(&store, &stock).await.as_deref(),
            Some("8"),
            "a late copy of an earlier phase was applied again"
        );
        let record = store.get(&scope).await.unwrap().unwrap();
        assert_eq!(
            record.recovery_point.as_deref(),
            Some("charged"),
            "the late copy moved the point back"
        );
    }

    /// The other fenced writes, each delivered again after its reply was lost
    /// and after other writes ran: answered like the first delivery (applied),
    /// and nothing is written by the second one.
    #[tokio::test]
    async fn resent_final_writes_answer_like_their_first_delivery() {
        let Some(store) = test_store().await else { return };
        let publish = store.publish;
        let key = |k: &str| Scope::new(Account::new("a"), IdempotencyKey::parse(k).unwrap());
        let mut failures = Vec::new();

        // Abandon, then a takeover whose holder heartbeats and advances.
        let s = key("resent-abandon");
        let first = claimed(&store, &s, "attempt-1").await;
        store
            .record_phase(&s, first.token, "charged", None)
            .await
            .unwrap();
        let abandon = |c: &mut Cmd| {
            c.arg("").arg("boom").arg(publish);
        };
        deliver(&store, &SCRIPTS.abandon, &s, first.token, &abandon, "A1")
            .await
            .unwrap();
        let second = claimed(&store, &s, "attempt-2").await;
        deliver(
            &store,
            &SCRIPTS.heartbeat,
            &s,
            second.token,
            &heartbeat_args,
            "A2",
        )
        .await
        .unwrap();
        store
            .advance_as(&s, second.token, &phase("shipped"), &[], "A3")
            .await
            .unwrap();
        let again = deliver(&store, &SCRIPTS.abandon, &s, first.token, &abandon, "A1").await;
        if again.is_err() {
            failures.push(format!("abandon re-sent after a takeover: {again:?}"));
        }
        let record = store.get(&s).await.unwrap().unwrap();
        assert_eq!(record.fencing_token, second.token, "the re-sent abandon wrote");

        // Park, then an operator's release, a takeover and its heartbeat.
        let s = key("resent-park");
        let first = claimed(&store, &s, "attempt-1").await;
        store
            .record_phase(&s, first.token, "charged", None)
            .await
            .unwrap();
        let park = |c: &mut Cmd| {
            c.arg("").arg("needs a human").arg(publish);
        };
        deliver(&store, &SCRIPTS.park, &s, first.token, &park, "P1")
            .await
            .unwrap();
        assert!(store.operator_release(&s, false).await.unwrap());
        let second = claimed(&store, &s, "attempt-2").await;
        deliver(
            &store,
            &SCRIPTS.heartbeat,
            &s,
            second.token,
            &heartbeat_args,
            "P2",
        )
        .await
        .unwrap();
        let again = deliver(&store, &SCRIPTS.park, &s, first.token, &park, "P1").await;
        if again.is_err() {
            failures.push(format!(
                "park re-sent after an operator's release and a takeover: {again:?}"
            ));
        }
        let record = store.get(&s).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            idemkit_core::RecordState::InFlight,
            "the re-sent park wrote"
        );

        // Release (nothing recorded), then a new request reuses the key.
        let s = key("resent-release");
        let first = claimed(&store, &s, "attempt-1").await;
        let release = |c: &mut Cmd| {
            c.arg(publish).arg("").arg(RELEASE_REFUSED).arg("0");
        };
        deliver(&store, &SCRIPTS.release, &s, first.token, &release, "R1")
            .await
            .unwrap();
        let second = claimed(&store, &s, "attempt-2").await;
        let again = deliver(&store, &SCRIPTS.release, &s, first.token, &release, "R1").await;
        if again.is_err() {
            failures.push(format!("release re-sent after the key was reused: {again:?}"));
        }
        let record = store.get(&s).await.unwrap().unwrap();
        assert_eq!(
            (record.state, record.fencing_token),
            (idemkit_core::RecordState::InFlight, second.token),
            "the re-sent release wrote"
        );

        // Complete, then a heartbeat of the same holder (refused: completed).
        let s = key("resent-complete");
        let first = claimed(&store, &s, "attempt-1").await;
        let complete = |c: &mut Cmd| {
            c.arg("").arg(201).arg("[]").arg("done").arg(publish);
        };
        deliver(&store, &SCRIPTS.complete, &s, first.token, &complete, "C1")
            .await
            .unwrap();
        assert!(matches!(
            deliver(&store, &SCRIPTS.heartbeat, &s, first.token, &heartbeat_args, "C2").await,
            Err(StoreError::Fenced)
        ));
        let again = deliver(&store, &SCRIPTS.complete, &s, first.token, &complete, "C1").await;
        if again.is_err() {
            failures.push(format!("complete re-sent after a heartbeat: {again:?}"));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
