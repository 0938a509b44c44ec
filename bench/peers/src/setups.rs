//! The setups: the same handler bare, under idemkit on each store, and under
//! the two peers, each on its own server.

use super::*;

/// How to tell how many times a setup's handler ran (rows or counter).
#[derive(Clone)]
pub(crate) enum Runs {
    Memory(Arc<AtomicU64>),
    Sqlite(Arc<SqliteStore>),
    Pg(Arc<PgStore>),
}

impl Runs {
    pub(crate) async fn count(&self, server: &Handle) -> i64 {
        match self.clone() {
            Self::Memory(ids) => ids.load(Ordering::Relaxed) as i64,
            Self::Sqlite(store) => server
                .spawn(async move {
                    sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM orders")
                        .fetch_one(store.pool())
                        .await
                        .unwrap()
                })
                .await
                .unwrap(),
            Self::Pg(store) => server
                .spawn(async move {
                    sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM orders")
                        .fetch_one(store.pool())
                        .await
                        .unwrap()
                })
                .await
                .unwrap(),
        }
    }
}

/// Which bare setup a setup is compared with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Family {
    Sqlite,
    Pg,
    Memory,
}

pub(crate) struct Setup {
    pub(crate) name: &'static str,
    pub(crate) family: Family,
    /// `None` for a bare setup; else the header a replayed response carries.
    pub(crate) replay_marker: Option<&'static str>,
    pub(crate) url: String,
    pub(crate) client: reqwest::Client,
    /// One `Cookie` header per client task (axum-idempotent's session), else empty.
    pub(crate) cookies: Vec<String>,
    pub(crate) runs: Runs,
    /// SQLite setups: the statements their connections have run.
    pub(crate) statements: Option<&'static AtomicU64>,
}

pub(crate) type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(CONCURRENCY)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Builds the app on the server runtime (stores spawn their tasks there), serves
/// it on a loopback port, and returns its URL.
pub(crate) async fn serve(server: &Handle, build: BoxFut<Router>) -> String {
    server
        .spawn(async move {
            let app = build.await;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
            format!("http://{addr}")
        })
        .await
        .unwrap()
}

pub(crate) async fn setup(
    server: &Handle,
    name: &'static str,
    family: Family,
    replay_marker: Option<&'static str>,
    runs: Runs,
    build: BoxFut<Router>,
) -> Setup {
    let base = serve(server, build).await;
    Setup {
        name,
        family,
        replay_marker,
        url: format!("{base}/orders"),
        client: client(),
        cookies: Vec::new(),
        runs,
        statements: None,
    }
}

pub(crate) const SQLITE_ORDERS: &str = "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, \
                             sku TEXT NOT NULL, quantity INTEGER NOT NULL)";
pub(crate) const PG_ORDERS: &str = "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL, \
                         sku TEXT NOT NULL, quantity BIGINT NOT NULL)";

/// Counts every statement SQLite starts on a connection (`sqlite3_trace_v2`,
/// `SQLITE_TRACE_STMT`): `BEGIN`, `COMMIT` and every query, whoever sends it.
extern "C" fn count_statement(
    _mask: std::os::raw::c_uint,
    ctx: *mut std::os::raw::c_void,
    _statement: *mut std::os::raw::c_void,
    _sql: *mut std::os::raw::c_void,
) -> std::os::raw::c_int {
    // SAFETY: `ctx` is the leaked `AtomicU64` registered in `sqlite_store`.
    let counter = unsafe { &*(ctx as *const AtomicU64) };
    counter.fetch_add(1, Ordering::Relaxed);
    0
}

/// A store on `path` as `SqliteStore::connect` makes it (WAL, synchronous NORMAL,
/// no ping on acquire), whose connections count the statements SQLite runs.
pub(crate) async fn sqlite_store(server: &Handle, path: PathBuf) -> (Arc<SqliteStore>, &'static AtomicU64) {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
    let statements: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let store = server
        .spawn(async move {
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(5));
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .after_connect(move |conn, _| {
                    Box::pin(async move {
                        let mut handle = conn.lock_handle().await?;
                        // SAFETY: the handle is locked for the call; the callback
                        // only touches the leaked counter, which outlives the pool.
                        unsafe {
                            libsqlite3_sys::sqlite3_trace_v2(
                                handle.as_raw_handle().as_ptr(),
                                libsqlite3_sys::SQLITE_TRACE_STMT as u32,
                                Some(count_statement),
                                statements as *const AtomicU64 as *mut std::os::raw::c_void,
                            );
                        }
                        Ok(())
                    })
                })
                .connect_with(options)
                .await
                .unwrap();
            let store = SqliteStore::from_pool(pool).await.unwrap();
            assert!(store.keys_loaded().await);
            sqlx::query(SQLITE_ORDERS).execute(store.pool()).await.unwrap();
            Arc::new(store)
        })
        .await
        .unwrap();
    (store, statements)
}

pub(crate) async fn pg_store(server: &Handle, url: String, schema: String) -> Arc<PgStore> {
    server
        .spawn(async move {
            let config = PgConfig::default().with_schema(schema).with_max_connections(8);
            let store = PgStore::connect_with(&url, config).await.unwrap();
            // The pool's search_path puts this in the fresh schema.
            sqlx::query(PG_ORDERS).execute(store.pool()).await.unwrap();
            Arc::new(store)
        })
        .await
        .unwrap()
}

pub(crate) fn layer_err(e: impl std::fmt::Debug) -> ! {
    panic!("layer configuration: {e:?}")
}

pub(crate) async fn sessions_for(setup: &mut Setup) {
    // axum-idempotent caches only for a request that already carries a session and
    // never creates one: each client task logs in once and keeps its cookie.
    let login = setup.url.replace("/orders", "/login");
    for _ in 0..CONCURRENCY {
        let res = setup
            .client
            .post(&login)
            .header("authorization", "Bearer bench")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::NO_CONTENT, "login");
        let cookie = res
            .headers()
            .get(header::SET_COOKIE)
            .expect("the session layer sets a cookie")
            .to_str()
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .to_owned();
        setup.cookies.push(cookie);
    }
}

pub(crate) async fn login(session: ruts::Session<ruts::store::moka::MokaStore>) -> StatusCode {
    session
        .set("account", &"bench", ruts::store::Ttl::new(3600).unwrap(), None)
        .await
        .unwrap();
    StatusCode::NO_CONTENT
}
