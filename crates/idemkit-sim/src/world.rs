//! One schedule: the store, the instances (each the real `IdempotencyLayer`
//! in front of an axum router), the clients, the completer, the reaper and the
//! operator, run to the end under the scheduler, then checked.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post;
use futures::FutureExt;
use http::Request;
use idemkit_core::{IdempotencyKey, KeyStore, Millis, Policy, Scope};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_sqlite::{SqliteConfig, SqliteStore};
use idemkit_testkit::MemoryStore;
use idemkit_tower::{Completer, Reaper};
use tower::ServiceExt;

use crate::adapter::{lease_layer, single_step_layer};
use crate::check::{self, Answer, Violation};
use crate::mutants::{Leaks, Mutant, Mutation, TxMutant};
use crate::operator;
use crate::sched::{Faults, Sched, SchedStats, Strategy, VirtualClock};
use crate::store::{Instrumented, Log, MemTx};

mod client;
mod grpc;
mod handlers;
mod proxy;

use handlers::{
    AppState, HandlerError, OrderState, Underway, echo, item_of, order, order_pg, pay, pay_steps,
};
pub use handlers::{Effects, Shared};

/// Which store a schedule runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreKind {
    /// `idemkit_testkit::MemoryStore` (lease mode; phases through [`MemTx`]).
    Memory,
    /// `idemkit_sqlite::SqliteStore` on a temporary file (lease mode with
    /// phases, and single-step mode with a business row in the same database).
    Sqlite,
    /// `idemkit_postgres::PgStore` at `IDEMKIT_TEST_POSTGRES_URL`, in a fresh
    /// schema dropped afterwards; every handle's database clock replaced by
    /// the virtual clock (`with_test_clock`). Best-effort deterministic.
    Postgres,
    /// `idemkit_redis::RedisStore` at `IDEMKIT_TEST_REDIS_URL` under a key
    /// prefix of its own (deleted afterwards), the server's clock replaced by
    /// the virtual clock; lease mode with phases through [`MemTx`].
    Redis,
}

impl StoreKind {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::Redis => "redis",
        }
    }
}

/// What one schedule runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The store.
    pub store: StoreKind,
    /// The seed every choice derives from.
    pub seed: u64,
    /// The scheduling strategy.
    pub strategy: Strategy,
    /// The faults.
    pub faults: Faults,
    /// A planted defect (negative controls).
    pub mutation: Option<Mutation>,
    /// Instances sharing the store.
    pub instances: usize,
    /// Adds a request whose handler panics on every run, after its first
    /// phase committed (a panic must not hold the key
    /// forever; it ends parked or in the review list).
    pub always_panic: bool,
    /// The small scenario (for the exhaustive strategy): one request sent by
    /// two clients and a different request under its key, no completer,
    /// reaper or operator while the clients run.
    pub small: bool,
    /// [`Strategy::Exhaustive`]: the choices to follow.
    pub prefix: Vec<usize>,
}

/// The result of one schedule.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Scheduler figures.
    pub stats: SchedStats,
    /// What the checker found.
    pub violations: Vec<Violation>,
    /// The scheduler's choices (with `IDEMKIT_SIM_TRACE` set).
    pub trace: Vec<String>,
    /// [`Strategy::Exhaustive`]: every choice made (chosen, options).
    pub choices: Vec<(usize, usize)>,
}

/// The route policy every instance runs: short lease and window so the
/// virtual clock crosses them within a schedule.
pub fn policy() -> Policy {
    Policy::new()
        .with_lease(LEASE)
        .with_replay_window(Duration::from_secs(600))
        .with_reap_threshold(Duration::from_secs(600))
}

/// The lease of every claim.
pub const LEASE: Duration = Duration::from_secs(6);
/// The completer's minimum age of an abandoned record.
pub const COMPLETER_AGE: Duration = Duration::from_secs(6);

/// One request the clients send (and retry).
#[derive(Debug, Clone)]
pub struct Spec {
    /// Index in the scenario.
    pub id: usize,
    /// Account (the bearer token).
    pub account: &'static str,
    /// Idempotency key.
    pub key: &'static str,
    /// Route path.
    pub path: &'static str,
    /// The request's own marker, echoed by every answer it executes.
    pub item: &'static str,
}

impl Spec {
    /// Whether its route is single-step (the claim, the business write and
    /// the answer in one transaction).
    pub fn single_step(&self) -> bool {
        self.path == "/order"
    }

    /// Whether it is a gRPC call (the tonic adapter's method).
    pub fn grpc(&self) -> bool {
        self.path == grpc::PAY
    }

    /// Whether it goes through the proxy to the simulated upstream.
    pub fn proxied(&self) -> bool {
        self.path.starts_with("/up/")
    }

    /// Its scope: the layers derive the account from the bearer token, the
    /// proxy from the whole `Authorization` header.
    pub fn scope(&self) -> Scope {
        let account = if self.proxied() {
            idemkit_core::Account::keyed(
                proxy::PROXY_SECRET.as_bytes(),
                format!("Bearer {}", self.account).as_bytes(),
            )
        } else {
            crate::adapter::account_of(self.account)
        };
        Scope::new(account, IdempotencyKey::parse(self.key).expect("a valid key"))
    }

    fn request(&self) -> Request<Bytes> {
        Request::post(self.path)
            .header("authorization", format!("Bearer {}", self.account))
            .header("idempotency-key", self.key)
            .header("content-type", "application/json")
            .body(Bytes::from(format!(r#"{{"item":"{}"}}"#, self.item)))
            .expect("a valid request")
    }
}

/// The requests of a scenario: a request sent by two clients, another
/// account's request under the same key, a different request under the first
/// one's key (a mismatch), a second key (single-step on SQLite), a plain
/// lease-mode request with a mismatch of its own, and a request through the
/// proxy and one over gRPC (each sent by two clients; gRPC on every store but
/// SQLite), each with a mismatch of its own (and, over gRPC, another
/// account's request under the same key).
pub fn scenario(store: StoreKind, always_panic: bool) -> Vec<Spec> {
    let second = match store {
        StoreKind::Sqlite | StoreKind::Postgres => "/order",
        StoreKind::Memory | StoreKind::Redis => "/pay",
    };
    let mut specs = vec![
        Spec {
            id: 0,
            account: "acct-a",
            key: "key-1",
            path: "/pay",
            item: "a1",
        },
        Spec {
            id: 1,
            account: "acct-b",
            key: "key-1",
            path: "/pay",
            item: "b1",
        },
        Spec {
            id: 2,
            account: "acct-a",
            key: "key-1",
            path: "/pay",
            item: "a1-other",
        },
        Spec {
            id: 3,
            account: "acct-a",
            key: "key-2",
            path: second,
            item: "a2",
        },
    ];
    // A plain lease-mode route whose answer the layer stores (and caches on
    // the instances with a replay cache), and a different request under its key.
    for item in ["e1", "e1-other"] {
        specs.push(Spec {
            id: specs.len(),
            account: "acct-a",
            key: "key-4",
            path: "/echo",
            item,
        });
    }
    // gRPC on every store but SQLite: its requests run the same lease-mode
    // phases as `/pay` (which SQLite runs), and on SQLite's one writer they
    // halved the schedules a budget reaches.
    let grpc: &[(&'static str, &'static str)] = match store {
        StoreKind::Sqlite => &[],
        StoreKind::Memory | StoreKind::Postgres | StoreKind::Redis => {
            &[("acct-g", "g1"), ("acct-g", "g1-other"), ("acct-h", "h1")]
        }
    };
    for &(account, item) in grpc {
        specs.push(Spec {
            id: specs.len(),
            account,
            key: "key-6",
            path: grpc::PAY,
            item,
        });
    }
    for item in ["p1", "p1-other"] {
        specs.push(Spec {
            id: specs.len(),
            account: "acct-p",
            key: "key-5",
            path: "/up/ship",
            item,
        });
    }
    if always_panic {
        specs.push(Spec {
            id: specs.len(),
            account: "acct-c",
            key: "key-3",
            path: "/pay",
            item: "boom",
        });
    }
    specs
}

/// The small scenario: the lease-mode request `a1` (sent by two clients) and
/// a different request under its key.
pub fn small_scenario() -> Vec<Spec> {
    ["a1", "a1-other"]
        .into_iter()
        .enumerate()
        .map(|(id, item)| Spec {
            id,
            account: "acct-a",
            key: "key-1",
            path: "/pay",
            item,
        })
        .collect()
}

/// The store of a schedule, below the instances' handles.
enum Backing {
    Memory(Arc<Mutant<dyn KeyStore>>),
    Sqlite {
        store: SqliteStore,
        mutation: Option<Mutation>,
        path: std::path::PathBuf,
    },
    Postgres {
        store: PgStore,
        mutation: Option<Mutation>,
        schema: String,
    },
    Redis {
        /// Under a key prefix of this run's own (cleared at the end).
        store: RedisStore,
        mutation: Option<Mutation>,
    },
}

/// One process: its store handle and its application.
#[derive(Clone)]
struct Instance {
    id: usize,
    store: Arc<dyn KeyStore>,
    app: Router,
    /// The gRPC server (the tonic adapter).
    grpc: grpc::GrpcServer,
}

struct World {
    sched: Arc<Sched>,
    log: Log,
    shared: Arc<Shared>,
    backing: Backing,
    clock: VirtualClock,
    /// The uninstrumented view the checker reads.
    raw: Arc<dyn KeyStore>,
    instances: Mutex<Vec<Instance>>,
    answers: Mutex<Vec<Answer>>,
    restarts: Mutex<u64>,
    mutation: Option<Mutation>,
    /// Transactions a planted defect kept open.
    leaks: Leaks,
}

impl World {
    /// A new process in `slot`: its store handle, its routes behind the real
    /// layers, and its proxy.
    fn instance(&self, slot: usize) -> Instance {
        let mut inst = self.application(slot);
        let proxy = proxy::service(inst.store.clone(), self.shared.clone());
        // One router for everything the process serves, gRPC included: it is
        // what the completer replays records through, and a gRPC record
        // replayed through the REST routes alone is answered by their 404
        // fallback (behind a layer, that 404 is stored as the key's answer).
        inst.app = inst
            .app
            .route_service(proxy::PROXY_ROUTE, proxy)
            .route_service(grpc::PAY, grpc::routable(inst.grpc.clone()));
        inst
    }

    fn application(&self, slot: usize) -> Instance {
        let id = self.sched.new_instance();
        let mut skew = if slot == 0 { 0 } else { (slot as i64) * 150 };
        if slot == 1 && self.mutation == Some(Mutation::LeaseByCallerClock) {
            skew = i64::try_from(LEASE.as_millis()).unwrap_or(0) + 2000;
        }
        match &self.backing {
            Backing::Memory(m) => {
                let handle = Arc::new(MemTx(Arc::new(Instrumented::new(
                    m.clone(),
                    self.sched.clone(),
                    id,
                    self.log.clone(),
                ))));
                let app = Router::new()
                    .route("/pay", post(pay::<MemTx<Instrumented<Mutant<dyn KeyStore>>>>))
                    .route("/echo", post(echo));
                let app = app
                    .with_state(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    })
                    .layer(lease_layer(handle.clone(), slot % 2 == 1));
                Instance {
                    id,
                    grpc: grpc::server(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    }),
                    store: handle,
                    app,
                }
            }
            Backing::Sqlite { store, mutation, .. } => {
                let inner = store.clone().with_clock(Arc::new(self.clock.skewed(skew)));
                let handle = Arc::new(Instrumented::new(
                    Arc::new(Mutant::new(Arc::new(inner), *mutation)),
                    self.sched.clone(),
                    id,
                    self.log.clone(),
                ));
                type H = Instrumented<Mutant<SqliteStore>>;
                let pay_app = Router::new()
                    .route("/pay", post(pay::<H>))
                    .route("/echo", post(echo))
                    .with_state(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    })
                    .layer(lease_layer(handle.clone(), slot % 2 == 1));
                let order_app = Router::new()
                    .route("/order", post(order))
                    .with_state(OrderState {
                        shared: self.shared.clone(),
                        instance: id,
                    })
                    .layer(single_step_layer(Arc::new(TxMutant::new(
                        handle.clone(),
                        self.mutation,
                        self.leaks.clone(),
                    ))));
                Instance {
                    id,
                    grpc: grpc::server(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    }),
                    store: handle,
                    app: pay_app.merge(order_app),
                }
            }
            Backing::Redis { store, mutation, .. } => {
                let skew = if skew > 1000 { skew } else { 0 };
                let inner = store.clone().with_test_clock(Arc::new(self.clock.skewed(skew)));
                let handle = Arc::new(MemTx(Arc::new(Instrumented::new(
                    Arc::new(Mutant::new(Arc::new(inner), *mutation)),
                    self.sched.clone(),
                    id,
                    self.log.clone(),
                ))));
                type H = MemTx<Instrumented<Mutant<RedisStore>>>;
                let app = Router::new()
                    .route("/pay", post(pay::<H>))
                    .route("/echo", post(echo))
                    .with_state(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    })
                    .layer(lease_layer(handle.clone(), slot % 2 == 1));
                Instance {
                    id,
                    grpc: grpc::server(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    }),
                    store: handle,
                    app,
                }
            }
            Backing::Postgres { store, mutation, .. } => {
                // The database's clock is shared; only the mutant skews it.
                let skew = if skew > 1000 { skew } else { 0 };
                // A yield point between the lease claim's read and its
                // compare-and-swap, where another actor may act.
                let sched = self.sched.clone();
                let inner = store
                    .clone()
                    .with_test_clock(Arc::new(self.clock.skewed(skew)))
                    .with_test_pause(move |point| {
                        let sched = sched.clone();
                        Box::pin(async move { sched.inside(id, point).await })
                    });
                let handle = Arc::new(Instrumented::new(
                    Arc::new(Mutant::new(Arc::new(inner), *mutation)),
                    self.sched.clone(),
                    id,
                    self.log.clone(),
                ));
                type H = Instrumented<Mutant<PgStore>>;
                let pay_app = Router::new()
                    .route("/pay", post(pay::<H>))
                    .route("/echo", post(echo))
                    .with_state(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    })
                    .layer(lease_layer(handle.clone(), slot % 2 == 1));
                let order_app = Router::new()
                    .route("/order", post(order_pg))
                    .with_state(OrderState {
                        shared: self.shared.clone(),
                        instance: id,
                    })
                    .layer(single_step_layer(Arc::new(TxMutant::new(
                        handle.clone(),
                        self.mutation,
                        self.leaks.clone(),
                    ))));
                Instance {
                    id,
                    grpc: grpc::server(AppState {
                        store: handle.clone(),
                        shared: self.shared.clone(),
                    }),
                    store: handle,
                    app: pay_app.merge(order_app),
                }
            }
        }
    }

    /// A live instance for a client, restarting a crashed one now and then.
    fn pick(&self) -> Instance {
        let n = self.instances.lock().unwrap_or_else(|p| p.into_inner()).len();
        let slot = self.sched.with_rng(|r| r.below(n));
        let current = self.instances.lock().unwrap_or_else(|p| p.into_inner())[slot].clone();
        if !self.sched.is_dead(current.id) {
            return current;
        }
        // The process restarts: a new engine, a new store handle, same store.
        let fresh = self.instance(slot);
        *self.restarts.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.instances.lock().unwrap_or_else(|p| p.into_inner())[slot] = fresh.clone();
        fresh
    }

    fn live(&self) -> Instance {
        for _ in 0..64 {
            let i = self.pick();
            if !self.sched.is_dead(i.id) {
                return i;
            }
        }
        self.pick()
    }

    /// Sends `spec` once, after the faults stopped, with a minute to answer
    /// (the liveness and late-replay checks); records the answer.
    async fn send_final(&self, spec: &Spec) -> Answer {
        if spec.grpc() {
            return self.grpc_final(spec).await;
        }
        let inst = self.live();
        let call = async {
            let res = inst
                .app
                .clone()
                .oneshot(spec.request().map(Body::from))
                .await
                .expect("infallible router");
            let status = res.status().as_u16();
            let body = axum::body::to_bytes(res.into_body(), usize::MAX)
                .await
                .unwrap_or_default();
            (status, body.to_vec())
        };
        let call = std::panic::AssertUnwindSafe(call).catch_unwind();
        let answer = match tokio::time::timeout(Duration::from_secs(60), call).await {
            Ok(Ok((status, body))) => Answer::new(spec.id, status, body, true),
            // The instance crashed under the request: the connection reset.
            Ok(Err(_)) | Err(_) => Answer::hung_up(spec.id, true),
        };
        self.record(answer.clone());
        answer
    }

    /// Records an answer a client saw.
    fn record(&self, answer: Answer) {
        self.answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(answer);
    }

    async fn jobs(self: Arc<Self>) {
        for round in 0..6u32 {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let inst = self.live();
            let pass = async {
                if round % 2 == 0 {
                    let completer =
                        Completer::new(inst.store.clone(), inst.app.clone()).min_age(COMPLETER_AGE);
                    let _ = completer.run_once().await;
                } else {
                    let reaper = Reaper::new(inst.store.clone(), &policy());
                    let _ = reaper.run_once().await;
                }
            };
            // A pass on an instance that crashes under it dies with it.
            let _ = std::panic::AssertUnwindSafe(pass).catch_unwind().await;
        }
    }

    /// The operator: now and then looks at the parked records (`idemkit keys
    /// list --state parked`) or at a key a client asked about, and runs `idemkit
    /// keys release` or `idemkit keys complete` on it. What it knows is true:
    /// it says `--downstream-did-nothing` only when neither downstream acted,
    /// nor has a call under way, for any request under that key.
    async fn operator(self: Arc<Self>, specs: Vec<Spec>) {
        for _ in 0..4 {
            let wait = self.sched.with_rng(|r| r.millis(2000, 14000));
            tokio::time::sleep(wait).await;
            let inst = self.live();
            let act = async {
                let parked = if self.sched.with_rng(|r| r.chance(0.5)) {
                    let filter = idemkit_core::ListFilter {
                        state: Some(idemkit_core::RecordState::Parked),
                        ..Default::default()
                    };
                    inst.store.list(&filter).await.unwrap_or_default()
                } else {
                    Vec::new()
                };
                let scope = if parked.is_empty() {
                    specs[self.sched.with_rng(|r| r.below(specs.len()))].scope()
                } else {
                    parked[self.sched.with_rng(|r| r.below(parked.len()))]
                        .scope
                        .clone()
                };
                let nothing = {
                    let fx = self.shared.effects.lock().unwrap_or_else(|p| p.into_inner());
                    specs
                        .iter()
                        .filter(|s| s.scope() == scope)
                        .all(|s| !fx.touched(s.item))
                };
                match self.sched.with_rng(|r| r.below(10)) {
                    0..=2 => {
                        let done =
                            operator::complete(inst.store.clone(), inst.app.clone(), COMPLETER_AGE).await;
                        self.sched.note(|| format!("operator: keys complete -> {done:?}"));
                    }
                    n => {
                        // The flag only when the operator truly found nothing;
                        // even then not always (releasing without it is safe).
                        // The planted defect: an operator who says it anyway.
                        let lies = self.mutation == Some(Mutation::OperatorLies);
                        let flag = (nothing || lies) && n >= 5;
                        if flag {
                            crate::store::push(
                                &self.log,
                                crate::store::Event::OperatorAttested {
                                    scope: scope.clone(),
                                    truthful: nothing,
                                },
                            );
                        }
                        let done = operator::release(&*inst.store, &scope, flag).await;
                        self.sched.note(|| {
                            format!(
                                "operator: keys release {}/{}{} -> {done:?}",
                                scope.account.as_str(),
                                scope.key.as_str(),
                                if flag { " --downstream-did-nothing" } else { "" }
                            )
                        });
                    }
                }
            };
            let _ = std::panic::AssertUnwindSafe(act).catch_unwind().await;
        }
    }
}

fn clock_elapsed(c: &VirtualClock) -> Duration {
    use idemkit_core::Clock;
    Duration::from_millis((c.now().0 - 1_700_000_000_000).max(0) as u64)
}

/// Runs `fut` in a task and spins until it ends, so that paused time does
/// not auto-advance while it waits on I/O (the checker's own store reads).
async fn busy_wait<T: Send + 'static>(fut: impl Future<Output = T> + Send + 'static) -> T {
    let handle = tokio::spawn(fut);
    while !handle.is_finished() {
        tokio::task::yield_now().await;
        std::thread::yield_now();
    }
    handle.await.expect("the checker does not panic")
}

/// Drives the runtime until `done` holds, releasing one parked task at a time.
async fn drive(sched: &Sched, done: impl Fn() -> bool, horizon: Duration) -> Result<(), String> {
    let until = tokio::time::Instant::now() + horizon;
    let mut steps = 0u64;
    let mut waiting_since: Option<std::time::Instant> = None;
    loop {
        sched.settle().await;
        if done() {
            return Ok(());
        }
        if !sched.step() {
            if tokio::time::Instant::now() >= until {
                return Err(format!("no progress within {horizon:?} of virtual time"));
            }
            // A store call still running with nothing else to release: wait
            // for it (real time) before letting virtual time move, so a slow
            // I/O does not let timers fire early.
            if sched.in_store() {
                let since = *waiting_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() < sched.io_patience() {
                    std::thread::yield_now();
                    continue;
                }
                if std::env::var_os("IDEMKIT_SIM_DEBUG").is_some() {
                    eprintln!(
                        "sim-debug: virtual time moves under a running call after {:?}: {:?}",
                        since.elapsed(),
                        sched.running()
                    );
                }
            }
            waiting_since = None;
            sched.idle(Duration::from_secs(30)).await;
        } else {
            waiting_since = None;
        }
        steps += 1;
        if steps > 200_000 {
            return Err("more than 200000 steps".into());
        }
    }
}

fn all_done<T>(handles: &[tokio::task::JoinHandle<T>]) -> bool {
    handles.iter().all(|h| h.is_finished())
}

/// Opens a fresh schema at `IDEMKIT_TEST_POSTGRES_URL`.
async fn open_postgres(seed: u64) -> Result<(PgStore, String), String> {
    let url = std::env::var("IDEMKIT_TEST_POSTGRES_URL")
        .map_err(|_| "set IDEMKIT_TEST_POSTGRES_URL to simulate PostgreSQL".to_owned())?;
    let schema = format!("idemkit_sim_{}_{seed:x}", std::process::id());
    // One pool for every instance, with room for each actor's connection: a
    // call parked inside a claim (the store's test pause) keeps its
    // connection, and a call waiting on the pool is a wait the scheduler
    // cannot see.
    let config = PgConfig::default()
        .with_schema(schema.clone())
        .with_max_connections(32);
    let store = PgStore::connect_with(&url, config)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query("CREATE TABLE IF NOT EXISTS sim_orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .map_err(|e| e.to_string())?;
    Ok((store, schema))
}

/// Connects to `IDEMKIT_TEST_REDIS_URL` under a fresh key prefix.
async fn open_redis(seed: u64) -> Result<RedisStore, String> {
    let url = std::env::var("IDEMKIT_TEST_REDIS_URL")
        .map_err(|_| "set IDEMKIT_TEST_REDIS_URL to simulate Redis".to_owned())?;
    let prefix = format!("idemkit-sim:{}:{seed:x}:", std::process::id());
    let config = RedisConfig::default().with_prefix(prefix);
    RedisStore::connect_with(&url, config)
        .await
        .map_err(|e| e.to_string())
}

async fn open_sqlite(seed: u64) -> (SqliteStore, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!(
        "idemkit-sim-{}-{seed:x}-{}.db",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let config = SqliteConfig::default().with_checkpoint_interval(Duration::ZERO);
    let store = SqliteStore::connect_with(&path, config)
        .await
        .expect("open sqlite");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS sim_orders (id INTEGER PRIMARY KEY AUTOINCREMENT, item TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await
    .expect("create sim_orders");
    store.keys_loaded().await;
    (store, path)
}

/// Runs one schedule on a fresh runtime and store; checks it.
pub fn run(config: &Config) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let outcome = rt.block_on(run_inner(config));
    drop(rt);
    outcome
}

async fn run_inner(config: &Config) -> Outcome {
    let sqlite = match config.store {
        StoreKind::Sqlite => Some(open_sqlite(config.seed).await),
        StoreKind::Memory | StoreKind::Postgres | StoreKind::Redis => None,
    };
    let redis = match config.store {
        StoreKind::Redis => match open_redis(config.seed).await {
            Ok(r) => Some(r),
            Err(e) => {
                return Outcome {
                    stats: SchedStats::default(),
                    violations: vec![Violation::stuck(format!("cannot open Redis: {e}"))],
                    trace: Vec::new(),
                    choices: Vec::new(),
                };
            }
        },
        _ => None,
    };
    let postgres = match config.store {
        StoreKind::Postgres => match open_postgres(config.seed).await {
            Ok(pg) => Some(pg),
            Err(e) => {
                return Outcome {
                    stats: SchedStats::default(),
                    violations: vec![Violation::stuck(format!("cannot open PostgreSQL: {e}"))],
                    trace: Vec::new(),
                    choices: Vec::new(),
                };
            }
        },
        _ => None,
    };
    // From here on time is virtual: it moves only when every task waits.
    tokio::time::pause();
    let clock = VirtualClock::new(Millis(1_700_000_000_000), 0);
    let sched = Sched::new(config.seed, config.strategy, config.faults);
    sched.follow(config.prefix.clone());
    sched.set_real_io(config.store != StoreKind::Memory);
    let log: Log = Arc::default();
    let backing = match (sqlite, postgres) {
        (None, None) if redis.is_some() => {
            let store = redis.expect("checked");
            Backing::Redis {
                store: store.with_test_clock(Arc::new(clock.clone())),
                mutation: config.mutation,
            }
        }
        (Some((store, path)), _) => Backing::Sqlite {
            store: store.with_clock(Arc::new(clock.clone())),
            mutation: config.mutation,
            path,
        },
        (None, Some((store, schema))) => Backing::Postgres {
            store: store.with_test_clock(Arc::new(clock.clone())),
            mutation: config.mutation,
            schema,
        },
        (None, None) => {
            let base: Arc<dyn KeyStore> = match config.mutation {
                Some(Mutation::Testkit(m)) => Arc::new(idemkit_testkit::mutants::MutantStore::with_clock(
                    m,
                    Arc::new(clock.clone()),
                )),
                _ => Arc::new(MemoryStore::with_clock(Arc::new(clock.clone()))),
            };
            let m: Arc<Mutant<dyn KeyStore>> = Arc::new(Mutant::new(base, config.mutation));
            Backing::Memory(m)
        }
    };
    let raw: Arc<dyn KeyStore> = match &backing {
        Backing::Memory(m) => m.clone(),
        Backing::Sqlite { store, mutation, .. } => Arc::new(Mutant::new(Arc::new(store.clone()), *mutation)),
        Backing::Postgres { store, mutation, .. } => {
            Arc::new(Mutant::new(Arc::new(store.clone()), *mutation))
        }
        Backing::Redis { store, mutation, .. } => Arc::new(Mutant::new(Arc::new(store.clone()), *mutation)),
    };
    let world = Arc::new(World {
        sched: sched.clone(),
        log: log.clone(),
        shared: Arc::new(Shared {
            sched: sched.clone(),
            effects: Mutex::default(),
        }),
        backing,
        clock,
        raw,
        instances: Mutex::new(Vec::new()),
        answers: Mutex::default(),
        restarts: Mutex::new(0),
        mutation: config.mutation,
        leaks: Leaks::default(),
    });
    let first: Vec<Instance> = (0..config.instances.max(1)).map(|s| world.instance(s)).collect();
    *world.instances.lock().unwrap_or_else(|p| p.into_inner()) = first;

    let specs = if config.small {
        small_scenario()
    } else {
        scenario(config.store, config.always_panic)
    };
    let mut violations = Vec::new();
    // Every record is completed after this instant, so it is still inside
    // its replay window until this instant plus the window.
    let started = tokio::time::Instant::now();

    // Phase 1: clients (two for the first request), jobs and the operator, with faults.
    let mut handles = Vec::new();
    let twice = specs.iter().filter(|s| ["a1", "g1", "p1"].contains(&s.item));
    for spec in specs.iter().chain(twice) {
        handles.push(tokio::spawn(world.clone().client(spec.clone())));
    }
    let background = if config.small {
        Vec::new()
    } else {
        vec![
            tokio::spawn(world.clone().jobs()),
            tokio::spawn(world.clone().operator(specs.clone())),
        ]
    };
    if let Err(e) = drive(&sched, || all_done(&handles), Duration::from_secs(900)).await {
        violations.push(Violation::stuck(format!("clients did not finish: {e}")));
    }
    // Phase 2: faults stop; the background jobs end; the clock passes the
    // lease and the completer's age; the completer runs, a lease apart, as many
    // times as a record may need to settle: at least twice, and once per run a
    // handler that panics every time gets before it is parked (the policy's
    // bound), so liveness means "settled within that bound".
    sched.note(|| format!("clients done at +{:?}", clock_elapsed(&world.clock)));
    // Single-step: every attempt's transaction has ended (committed or rolled
    // back) once its client is done, so no single-step key is held.
    let held = {
        let (raw, specs) = (world.raw.clone(), specs.clone());
        busy_wait(async move { check::single_step_free(&raw, &specs).await }).await
    };
    violations.extend(held);
    sched.set_faults(false);
    // The jobs and the operator stop (one on a crashed instance never returns).
    for b in &background {
        b.abort();
    }
    let liveness = {
        let world = world.clone();
        tokio::spawn(async move {
            let passes = idemkit_core::Policy::new().panic_limit.max(2);
            for _ in 0..passes {
                tokio::time::sleep(LEASE + COMPLETER_AGE + Duration::from_secs(1)).await;
                let inst = world.live();
                let completer = Completer::new(inst.store.clone(), inst.app.clone()).min_age(COMPLETER_AGE);
                let _ = completer.run_once().await.map_err(|e| {
                    world.sched.note(|| format!("completer pass failed: {e}"));
                });
            }
        })
    };
    let handles = vec![liveness];
    if let Err(e) = drive(&sched, || all_done(&handles), Duration::from_secs(900)).await {
        violations.push(Violation::stuck(format!("the completer did not finish: {e}")));
    }
    sched.note(|| format!("liveness check at +{:?}", clock_elapsed(&world.clock)));
    let settled = {
        let (raw, specs) = (world.raw.clone(), specs.clone());
        busy_wait(async move { check::settled(&raw, &specs).await }).await
    };
    violations.extend(settled);
    // Phase 3: one final request per request: none may answer "in progress".
    let finals = {
        let world = world.clone();
        let specs = specs.clone();
        tokio::spawn(async move {
            for s in &specs {
                world.send_final(s).await;
            }
        })
    };
    let handles = vec![finals];
    if let Err(e) = drive(&sched, || all_done(&handles), Duration::from_secs(900)).await {
        violations.push(Violation::stuck(format!("final requests did not finish: {e}")));
    }
    // Phase 4: every request once more, late but inside every record's
    // window (nine tenths of it after the run began, before any record was
    // completed): each must replay its stored answer. A store that measures
    // the window short (by more than about a tenth plus the run's length)
    // runs the request again instead, which the checker sees as a reopened
    // record, a second effect or another answer.
    let late = {
        let world = world.clone();
        let specs = specs.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(started + policy().replay_window * 9 / 10).await;
            world
                .sched
                .note(|| format!("late replays at +{:?}", clock_elapsed(&world.clock)));
            for s in &specs {
                world.send_final(s).await;
            }
        })
    };
    let handles = vec![late];
    if let Err(e) = drive(&sched, || all_done(&handles), Duration::from_secs(900)).await {
        violations.push(Violation::stuck(format!("late replays did not finish: {e}")));
    }
    let answers = world.answers.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let events = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let rows = match &world.backing {
        Backing::Sqlite { store, .. } => {
            let pool = store.pool().clone();
            busy_wait(async move {
                sqlx::query_as::<_, (String, i64)>("SELECT item, COUNT(*) FROM sim_orders GROUP BY item")
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_default()
            })
            .await
        }
        Backing::Postgres { store, .. } => {
            let pool = store.pool().clone();
            busy_wait(async move {
                sqlx::query_as::<_, (String, i64)>("SELECT item, COUNT(*) FROM sim_orders GROUP BY item")
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_default()
            })
            .await
        }
        Backing::Memory(_) | Backing::Redis { .. } => Vec::new(),
    };
    {
        let fx = std::mem::take(&mut *world.shared.effects.lock().unwrap_or_else(|p| p.into_inner()));
        let (raw, specs) = (world.raw.clone(), specs.clone());
        let found =
            busy_wait(async move { check::safety(&specs, &answers, &events, &fx, &rows, &raw).await }).await;
        violations.extend(found);
    }
    // Phase 5 (after the safety check, which reads the records the reaper
    // deletes): past every record's reap threshold, the reaper's pass; then
    // every request whose record was unfinished (parked) before it, once more:
    // each is in the review list, still parked, and never runs again.
    let wait = tokio::spawn(async move {
        tokio::time::sleep_until(started + policy().reap_threshold * 2).await;
    });
    let handles = vec![wait];
    if let Err(e) = drive(&sched, || all_done(&handles), Duration::from_secs(3000)).await {
        violations.push(Violation::stuck(format!(
            "the clock did not reach the reap threshold: {e}"
        )));
    }
    let unfinished = {
        let (raw, specs) = (world.raw.clone(), specs.clone());
        busy_wait(async move { check::unfinished(&raw, &specs).await }).await
    };
    let reaped = {
        let world = world.clone();
        let (specs, unfinished) = (specs.clone(), unfinished.clone());
        tokio::spawn(async move {
            let inst = world.live();
            let pass = Reaper::new(inst.store.clone(), &policy()).run_once().await;
            world.sched.note(|| {
                format!(
                    "reaper at +{:?}: {pass:?}; unfinished before it: {}",
                    clock_elapsed(&world.clock),
                    unfinished.len()
                )
            });
            let mut after = Vec::new();
            for s in specs.iter().filter(|s| unfinished.contains(&s.scope())) {
                after.push(world.send_final(s).await);
            }
            after
        })
    };
    let handles = vec![reaped];
    match drive(&sched, || all_done(&handles), Duration::from_secs(900)).await {
        Err(e) => violations.push(Violation::stuck(format!("the reaper's pass did not finish: {e}"))),
        Ok(()) => {
            let [reaped] = <[_; 1]>::try_from(handles).expect("one handle");
            let after = busy_wait(async move { reaped.await.unwrap_or_default() }).await;
            let (raw, specs) = (world.raw.clone(), specs.clone());
            // Every call a downstream got since the safety check is a run after the pass.
            let fx = std::mem::take(&mut *world.shared.effects.lock().unwrap_or_else(|p| p.into_inner()));
            let found =
                busy_wait(async move { check::reaped(&raw, &specs, &unfinished, &after, &fx).await }).await;
            violations.extend(found);
        }
    }
    let stats = sched.stats();
    let trace = sched.trace();
    let choices = sched.choices();
    // Kept-open transactions end before the store is cleaned up (a dropped
    // one rolls back on its connection's next use or return to the pool).
    world.leaks.lock().unwrap_or_else(|p| p.into_inner()).clear();
    match &world.backing {
        Backing::Sqlite { path, .. } => {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        }
        Backing::Postgres { store, schema, .. } => {
            let (pool, schema) = (store.pool().clone(), schema.clone());
            busy_wait(async move {
                // The schema name is ours (`idemkit_sim_<pid>_<hex>`), not input.
                let sql = sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
                let _ = sqlx::query(sql).execute(&pool).await;
            })
            .await;
        }
        Backing::Redis { store, .. } => {
            // Only this run's prefix: the server is shared.
            let store = store.clone();
            busy_wait(async move {
                let _ = store.clear_prefix().await;
            })
            .await;
        }
        Backing::Memory(_) => {}
    }
    Outcome {
        stats,
        violations,
        trace,
        choices,
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A real network round trip that takes `ms` of real time: a thread on
    /// the other end answers a byte after sleeping.
    async fn slow_round_trip(ms: u64) -> std::io::Result<()> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                let mut b = [0u8; 1];
                let _ = s.read_exact(&mut b);
                std::thread::sleep(Duration::from_millis(ms));
                let _ = s.write_all(&b);
            }
        });
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"x").await?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await?;
        Ok(())
    }

    /// Whether a 1 s timer of virtual time fired while an actor's 50 ms
    /// round trip was on the wire, with the round trip run as a scheduled
    /// call (`scheduled`) or bare.
    fn timer_fired_during_io(scheduled: bool) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        rt.block_on(async move {
            tokio::time::pause();
            let sched = Sched::new(1, Strategy::Random, Faults::NONE);
            let instance = sched.new_instance();
            let fired = Arc::new(AtomicBool::new(false));
            let timer = {
                let fired = fired.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    fired.store(true, Ordering::SeqCst);
                })
            };
            let actor = {
                let (sched, fired) = (sched.clone(), fired.clone());
                tokio::spawn(async move {
                    if scheduled {
                        let r = sched.io(instance, "business_write", slow_round_trip(50)).await;
                        r.expect("no faults").expect("the round trip");
                    } else {
                        slow_round_trip(50).await.expect("the round trip");
                    }
                    fired.load(Ordering::SeqCst)
                })
            };
            let handles = [actor];
            let driven = drive(
                &sched,
                || handles.iter().all(|h| h.is_finished()),
                Duration::from_secs(60),
            )
            .await;
            timer.abort();
            let [actor] = handles;
            match driven {
                Ok(()) => actor.await.expect("the actor"),
                // The driver's whole horizon of virtual time passed under the I/O.
                Err(_) => {
                    actor.abort();
                    true
                }
            }
        })
    }

    /// The PostgreSQL `Stuck: request a2 ... answers 0` finding: a
    /// single-step handler's business write is network I/O outside the store's
    /// calls; the driver saw nothing running, let paused time jump to the next
    /// timer while the write was on the wire, and the final request's 60 s
    /// timeout fired during a 2 ms INSERT. Run as a scheduled call, the driver
    /// waits for it.
    #[test]
    fn the_driver_waits_for_an_actors_io_before_moving_time() {
        assert!(
            !timer_fired_during_io(true),
            "a timer of virtual time fired while a scheduled call was on the wire"
        );
    }

    /// The hazard the test above guards against is real: bare I/O lets time jump.
    #[test]
    fn bare_io_lets_virtual_time_jump() {
        assert!(
            timer_fired_during_io(false),
            "virtual time did not move under bare I/O: the test above proves nothing"
        );
    }
}
