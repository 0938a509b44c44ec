//! `idemkit keys`: operator tooling over a key store (SQLite, PostgreSQL or Redis).
//!
//! - `list` shows records by state (`--state parked` is the list of requests
//!   awaiting a human), newest claim first;
//! - `show` prints one record: where it got to (recovery point, step outputs),
//!   the request it holds and the response it stored;
//! - `release` frees a record nobody holds (parked, or abandoned with an expired
//!   lease): without recorded progress the next request with the key runs as a
//!   first attempt; with progress (a committed phase, an external call's intent)
//!   the record stays resumable, so the rerun skips committed phases and parks
//!   again at an unfinished call to a downstream that ignores keys, unless the
//!   operator says `--downstream-did-nothing`;
//! - `complete` runs one completer pass over the routes this binary registers
//!   (the labels service's);
//! - `reap` runs one reaper pass; `review` prints the review list it fills.
//!
//! Every subcommand prints a table for people, or JSON with `--json`. Times are
//! RFC 3339 in UTC.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use idemkit::{OpenError, OpenMode, OpenOptions, OpenedStore, StoreKind};
use idemkit_core::{
    Account, IdempotencyKey, KeyStore, ListFilter, Millis, Policy, Record, RecordState, ReviewEntry, Scope,
    StoredHeader,
};
use idemkit_labels::service::{LabelsConfig, build};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_tower::{Completer, Reaper};
use serde_json::{Value, json};

/// The PostgreSQL schema `idemkit keys` reads unless told otherwise: the
/// library's default (`PgConfig::default().schema()`).
fn default_schema() -> String {
    PgConfig::default().schema().to_owned()
}

/// How much of a body the human output shows.
const BODY_PREVIEW: usize = 512;

/// How an account that runs unscoped is written on the command line and in tables.
const UNSCOPED_NAME: &str = "(unscoped)";

/// Arguments of `idemkit keys`.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// The key store (required): `postgres://…`, `redis://…`, `sqlite://…` or a SQLite
    /// file path (the service's `--database-url`, or its `--keys-url` on Redis).
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// PostgreSQL schema of the key store; default the library's, `idemkit` (the
    /// labels service keeps its keys in `labels` unless `IDEMKIT_PG_SCHEMA` is set).
    /// The schema must already hold a key store: `keys` never creates one, and its
    /// read commands (list, show, review) never migrate one.
    #[arg(long, global = true, env = "IDEMKIT_PG_SCHEMA", default_value_t = default_schema())]
    pub pg_schema: String,
    /// Machine-readable output (JSON) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: KeysCommand,
}

/// The `idemkit keys` subcommands.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List records, newest claim first.
    List(ListArgs),
    /// Show one record: state, recovery point, step outputs, request, response.
    Show(ScopeArgs),
    /// Release a record nobody holds (parked, or abandoned with an expired lease).
    /// Without recorded progress the next request with the key runs as a first
    /// attempt. With progress (committed phases, an external call's intent) the
    /// record is kept resumable: the rerun skips committed phases and parks again
    /// at an unfinished call to a downstream that ignores keys.
    Release(ReleaseArgs),
    /// Run the completer once over the labels service's routes.
    Complete(CompleteArgs),
    /// Run the reaper once: delete old completed and released records, move
    /// unfinished ones to the review list.
    Reap(ReapArgs),
    /// Print the review list (requests the reaper found unfinished), oldest first.
    Review(ReviewArgs),
}

/// A record state, as `--state` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// Claimed; held by a lease, or abandoned once the lease expired.
    #[value(name = "in_flight", alias = "in-flight")]
    InFlight,
    /// Finished with a stored response.
    Completed,
    /// Released: behaves as absent.
    Released,
    /// Parked for human review.
    Parked,
}

impl From<StateArg> for RecordState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::InFlight => Self::InFlight,
            StateArg::Completed => Self::Completed,
            StateArg::Released => Self::Released,
            StateArg::Parked => Self::Parked,
        }
    }
}

/// Arguments of `idemkit keys list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only records in this state.
    #[arg(long, value_enum)]
    pub state: Option<StateArg>,
    /// Only records of this account (`(unscoped)` for an unscoped deployment).
    #[arg(long)]
    pub account: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// One record, by account and key.
#[derive(Debug, Args)]
pub struct ScopeArgs {
    /// The record's account (`(unscoped)` for an unscoped deployment).
    #[arg(long)]
    pub account: String,
    /// The idempotency key.
    #[arg(long)]
    pub key: String,
}

/// Arguments of `idemkit keys release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// The record.
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The operator checked the downstream system and the recorded call did
    /// nothing there: discard the recorded progress (phases, intents) so the key
    /// reruns as a first attempt and calls the downstream again
    /// (`KeyStore::discard_progress`: only a record nobody holds, parked or in
    /// flight with an expired lease). Without it a record with progress stays
    /// resumable.
    #[arg(long)]
    pub downstream_did_nothing: bool,
}

/// Arguments of `idemkit keys complete`.
#[derive(Debug, Args)]
pub struct CompleteArgs {
    /// The courier's base URL (the labels service calls it to finish a label).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub courier_url: String,
    /// Only records claimed at least this long ago, in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pub min_age_ms: u64,
    /// Lease of each record the pass takes over, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Deadline of each courier call, retries included, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub courier_deadline_ms: u64,
    /// At most this many records in the pass.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// The labels service's idempotency configuration (TOML); default: its own `idemkit.toml`.
    #[arg(long, env = "IDEMKIT_CONFIG")]
    pub config: Option<PathBuf>,
    /// With a Redis key store (`--database-url redis://…`, the service's
    /// `--keys-url`): the labels rows' database, the service's `--database-url`
    /// (`postgres://…`, `sqlite://…` or an existing SQLite file).
    #[arg(long, value_name = "URL")]
    pub labels_database_url: Option<String>,
}

/// Arguments of `idemkit keys reap`.
#[derive(Debug, Args)]
pub struct ReapArgs {
    /// Reap records claimed (completed records: finished) more than this many
    /// hours ago; default the policy's reap threshold (72 h). Refused when
    /// shorter than the replay window: a completed record reaped inside its
    /// window would let a retry run the write again.
    #[arg(long)]
    pub older_than_hours: Option<u64>,
    /// The longest replay window of the routes this store serves, in hours
    /// (default the policy's, 24 h). The threshold may not be shorter.
    #[arg(long)]
    pub replay_window_hours: Option<u64>,
}

/// Arguments of `idemkit keys review`.
#[derive(Debug, Args)]
pub struct ReviewArgs {
    /// At most this many entries.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// Runs `idemkit keys`. Exit codes: 0 done; 1 `show` found no record,
/// `release` refused, or `complete` left records unfinished; an error (exit 2)
/// for `release --downstream-did-nothing` on a record with recorded progress
/// while the stores cannot discard it.
pub fn run(args: KeysArgs) -> anyhow::Result<ExitCode> {
    let url = args
        .database_url
        .clone()
        .context("--database-url is required (the key store's `postgres://…`, `sqlite://…` or file path)")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The exit code is the command's whatever happens to stdout (`| head`).
    let mut out = crate::VerdictOutput::new(std::io::stdout().lock());
    let code = runtime.block_on(async {
        match &args.command {
            KeysCommand::Complete(c) => complete(&mut out, &args, &url, c).await,
            command => {
                let access = match command {
                    KeysCommand::List(_) | KeysCommand::Show(_) | KeysCommand::Review(_) => Access::Read,
                    _ => Access::Write,
                };
                let store = open(&url, &args.pg_schema, access).await?;
                match command {
                    KeysCommand::List(l) => list(&mut out, &args, &*store, l).await,
                    KeysCommand::Show(s) => show(&mut out, &args, &*store, s).await,
                    KeysCommand::Release(r) => release(&mut out, &args, &*store, r).await,
                    KeysCommand::Reap(r) => reap(&mut out, &args, store, r).await,
                    KeysCommand::Review(r) => review(&mut out, &args, &*store, r).await,
                    KeysCommand::Complete(_) => unreachable!("handled above"),
                }
            }
        }
    });
    out.finish();
    code
}

/// What a subcommand does to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// `list`, `show`, `review`: no DDL, no migration, no write.
    Read,
    /// `release`, `reap`, `complete`: may bring an existing store's schema up to date.
    Write,
}

fn is_postgres(url: &str) -> bool {
    StoreKind::of(url) == StoreKind::Postgres
}

/// Opens the store behind `url`. An operator tool never invents an empty store:
/// a missing SQLite file or a PostgreSQL schema without a key store is an error.
async fn open(url: &str, schema: &str, access: Access) -> anyhow::Result<Arc<dyn KeyStore>> {
    let kind = StoreKind::of(url);
    if kind == StoreKind::Postgres {
        Ok(open_pg(url, schema, access).await?)
    } else if kind == StoreKind::Redis {
        // The key prefix: a `prefix` query parameter of the URL, else
        // `IDEMKIT_REDIS_PREFIX` (as the quickstart and services read it), else
        // the library's default. Connecting creates nothing.
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut prefix = std::env::var("IDEMKIT_REDIS_PREFIX")
            .ok()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| idemkit_redis::DEFAULT_PREFIX.to_owned());
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.strip_prefix("prefix=") {
                Some(p) => {
                    prefix = percent_encoding::percent_decode_str(p)
                        .decode_utf8()
                        .context("the `prefix` of the Redis URL is not UTF-8")?
                        .into_owned()
                }
                None => rest.push(pair),
            }
        }
        let base = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        let _ = access;
        let options = OpenOptions::new().with_redis_prefix(prefix.clone());
        let store = idemkit::open_store(&base, &options)
            .await
            .with_context(|| format!("connecting to the Redis key store at `{base}` (prefix `{prefix}`)"))?;
        Ok(store.key_store())
    } else {
        // Opening creates a missing file; an operator tool must not invent an empty store.
        let options = OpenOptions::new().with_mode(OpenMode::Existing);
        match idemkit::open_store(url, &options).await {
            Err(e @ OpenError::NoSqliteFile(_)) => Err(e.into()),
            opened => Ok(opened
                .with_context(|| format!("opening the SQLite key store at `{url}`"))?
                .key_store()),
        }
    }
}

/// Opens an existing PostgreSQL key store in `schema`, after checking that the
/// schema holds one (a clear error naming the schemas that do, otherwise) and,
/// for [`Access::Read`], that it needs no migration.
async fn open_pg(url: &str, schema: &str, access: Access) -> anyhow::Result<Arc<PgStore>> {
    let valid = schema.len() <= 63
        && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    anyhow::ensure!(valid, "schema `{schema}` must match [a-z_][a-z0-9_]{{0,62}}");
    let catalog = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .context("connecting to PostgreSQL")?;
    let found: Vec<String> = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = 'idemkit_keys' AND c.relkind IN ('r', 'p') ORDER BY 1",
    )
    .fetch_all(&catalog)
    .await
    .context("looking for idemkit key stores")?;
    if !found.iter().any(|s| s == schema) {
        catalog.close().await;
        let hint = match found.as_slice() {
            [] => "this database has no idemkit key store in any schema".to_owned(),
            [one] => format!("the key store of this database is in schema `{one}`: pass --pg-schema {one}"),
            many => format!(
                "key stores of this database are in schemas {}: pass --pg-schema with one of them",
                many.iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        anyhow::bail!("no idemkit key store in schema `{schema}` (nothing was created); {hint}");
    }
    if access == Access::Read {
        let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT version FROM {schema}._sqlx_migrations WHERE success"
        )))
        .fetch_all(&catalog)
        .await
        .with_context(|| format!("reading the migrations of the key store in schema `{schema}`"))?;
        let missing: Vec<String> = idemkit_postgres::MIGRATOR
            .iter()
            .filter(|m| !m.migration_type.is_down_migration() && !applied.contains(&m.version))
            .map(|m| format!("{} {}", m.version, m.description))
            .collect();
        if !missing.is_empty() {
            catalog.close().await;
            anyhow::bail!(
                "the key store in schema `{schema}` lacks migration(s) {}; read commands never \
                 migrate: upgrade it first (start the service on it, or run a write command such \
                 as `idemkit keys reap`)",
                missing.join(", ")
            );
        }
    }
    catalog.close().await;
    let mode = match access {
        Access::Read => OpenMode::NoMigrations,
        Access::Write => OpenMode::Existing,
    };
    let options = OpenOptions::new()
        .with_mode(mode)
        .with_pg_schema(schema)
        .with_max_connections(2);
    match idemkit::open_store(url, &options)
        .await
        .with_context(|| format!("opening the PostgreSQL key store (schema `{schema}`)"))?
    {
        OpenedStore::Postgres(store) => Ok(store),
        other => unreachable!("a postgres:// URL opened {}", other.kind()),
    }
}

mod commands;
mod render;

use commands::{complete, list, reap, release, review, show};
