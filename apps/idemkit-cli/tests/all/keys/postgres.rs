//! `idemkit keys` on PostgreSQL schemas it did not create: it never creates a
//! store, reads never migrate, and the library's default schema is found.

use super::*;

pub(super) async fn schema_exists(pool: &sqlx::PgPool, name: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `url` with its database replaced by `name`.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, String::new()), |(b, q)| (b, format!("?{q}")));
    let (server, _) = base.rsplit_once('/').expect("a database in the URL");
    format!("{server}/{name}{query}")
}

/// On PostgreSQL, a schema without a key store is a clear error naming the
/// schemas that have one, and nothing is created; read commands (list, show,
/// review) refuse a store that needs a migration instead of running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_postgres_never_create_a_store_and_reads_never_migrate() {
    let Some(db) = Db::postgres().await else {
        return;
    };
    prepare(&*db.store).await;
    let schema = db.schema.clone().unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();

    let missing = unique("t_nostore");
    let show = ["show", "--account", "acct-a", "--key", "k-done"];
    let release = ["release", "--account", "acct-a", "--key", "k-parked"];
    for command in [&["list"][..], &["review"], &show, &["reap"], &release] {
        let mut args: Vec<String> = ["keys"].iter().chain(command).map(|s| s.to_string()).collect();
        args.extend([
            "--database-url".into(),
            db.url.clone(),
            "--pg-schema".into(),
            missing.clone(),
        ]);
        let out = run(args, vec![]).await;
        assert_eq!(out.code, 2, "{command:?}: {out:#?}");
        assert!(
            out.stderr
                .contains(&format!("no idemkit key store in schema `{missing}`")),
            "{command:?}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains(&format!("`{schema}`")),
            "{command:?}: the schemas found are named: {}",
            out.stderr
        );
        assert!(
            !schema_exists(&pool, &missing).await,
            "{command:?} created the schema"
        );
    }

    // Undo the record of the last migration: a read must refuse, not re-run it.
    let last = idemkit_postgres::MIGRATOR
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {schema}._sqlx_migrations WHERE version = $1"
    )))
    .bind(last)
    .execute(&pool)
    .await
    .unwrap();
    for command in [&["list"][..], &["review"], &show] {
        let out = db.keys(command).await;
        assert_eq!(out.code, 2, "{command:?}: {out:#?}");
        assert!(
            out.stderr.contains("lacks migration") && out.stderr.contains("never migrate"),
            "{command:?}: {}",
            out.stderr
        );
        let recorded: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {schema}._sqlx_migrations WHERE version = $1"
        )))
        .bind(last)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(recorded, 0, "{command:?} ran the migration");
    }
    pool.close().await;
}

/// Without `--pg-schema` or `IDEMKIT_PG_SCHEMA`, `keys` reads the library's
/// default schema, `idemkit` (on a database of its own, so no other test's
/// store is in the way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reads_the_library_default_schema_on_postgres() {
    let Some(url) = postgres_url() else {
        return;
    };
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let name = unique("idemkit_keys_default");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    let db_url = with_database(&url, &name);
    let list = || {
        run(
            vec![
                "keys".into(),
                "list".into(),
                "--database-url".into(),
                db_url.clone(),
                "--json".into(),
            ],
            vec![],
        )
    };

    let empty = list().await;
    assert_eq!(empty.code, 2, "{empty:#?}");
    assert!(
        empty.stderr.contains("schema `idemkit`")
            && empty.stderr.contains("no idemkit key store in any schema"),
        "{}",
        empty.stderr
    );
    let pool = sqlx::PgPool::connect(&db_url).await.unwrap();
    assert!(
        !schema_exists(&pool, "idemkit").await,
        "a read created the schema"
    );
    pool.close().await;

    let store = PgStore::connect(&db_url).await.unwrap();
    let done = scope("acct-a", "k-default");
    let l = must_claim(&store, &claim_req(&done, r#"{"sku":"x"}"#)).await;
    store
        .complete(&done, l.token, &response(201, "{}"))
        .await
        .unwrap();
    let found = list().await;
    assert_eq!(found.code, 0, "{found:#?}");
    assert_eq!(keys_of(&found.report(), "records"), ["acct-a/k-default"]);
    // The store's listener holds a connection until the store is dropped; FORCE
    // ends whatever is left.
    drop(store);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
}
