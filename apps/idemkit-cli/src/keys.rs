//! `idemkit keys`: operator tooling over a key store (SQLite or PostgreSQL).
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
/// library's default (`PgConfig::default().schema`).
fn default_schema() -> String {
    PgConfig::default().schema
}

/// How much of a body the human output shows.
const BODY_PREVIEW: usize = 512;

/// How an account that runs unscoped is written on the command line and in tables.
const UNSCOPED_NAME: &str = "(unscoped)";

/// Arguments of `idemkit keys`.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// The key store (required): `postgres://…`, `sqlite://…` or a SQLite file path (the
    /// service's `--database-url`).
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

fn account_arg(s: &str) -> Account {
    if s == UNSCOPED_NAME {
        Account::unscoped()
    } else {
        Account::new(s)
    }
}

fn account_text(a: &Account) -> String {
    if a.as_str() == Account::UNSCOPED {
        UNSCOPED_NAME.to_owned()
    } else {
        a.as_str().escape_debug().to_string()
    }
}

fn scope_arg(s: &ScopeArgs) -> anyhow::Result<Scope> {
    let key = IdempotencyKey::parse(&s.key).map_err(|e| anyhow::anyhow!("--key: {e}"))?;
    Ok(Scope::new(account_arg(&s.account), key))
}

/// RFC 3339 in UTC, to the millisecond.
fn time(m: Millis) -> String {
    let t = SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(m.0).unwrap_or(0));
    humantime::format_rfc3339_millis(t).to_string()
}

/// RFC 3339 in UTC, to the second (tables).
fn time_s(m: Millis) -> String {
    let t = SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(m.0).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

/// What the lease/completion column says about a record at `now`.
fn lease_text(r: &Record, now: Millis) -> String {
    match r.state {
        RecordState::Completed => format!("completed {}", time_s(r.completed_at.unwrap_or(r.created_at))),
        RecordState::InFlight if r.lease_expires_at > now => {
            format!("held until {}", time_s(r.lease_expires_at))
        }
        RecordState::InFlight => format!("expired {}", time_s(r.lease_expires_at)),
        RecordState::Parked => format!("parked {}", time_s(r.lease_expires_at)),
        _ => "-".to_owned(),
    }
}

fn or_dash(s: Option<&str>) -> String {
    s.map_or_else(|| "-".to_owned(), one_line)
}

/// Newlines and other control characters would break a table row.
fn one_line(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

fn cut(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// A body as text: UTF-8 (lossy), cut to `max` bytes when given.
fn body_text(body: &[u8], max: Option<usize>) -> String {
    match max {
        Some(max) if body.len() > max => format!(
            "{}… ({} more bytes)",
            String::from_utf8_lossy(&body[..max]),
            body.len() - max
        ),
        _ => String::from_utf8_lossy(body).into_owned(),
    }
}

fn headers_json(headers: &[StoredHeader]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|h| json!({"name": h.name, "value": String::from_utf8_lossy(&h.value)}))
            .collect(),
    )
}

fn state_text(s: RecordState) -> &'static str {
    s.as_str()
}

/// Left-aligned columns under a header and a rule.
fn table(out: &mut impl Write, headers: &[&str], rows: &[Vec<String>]) -> anyhow::Result<()> {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let last = cells.len().saturating_sub(1);
        let mut s = String::new();
        for (i, (cell, w)) in cells.into_iter().zip(&widths).enumerate() {
            if i == last {
                s.push_str(&cell);
            } else {
                let pad = w - cell.chars().count();
                s.push_str(&cell);
                s.push_str(&" ".repeat(pad + 2));
            }
        }
        s.trim_end().to_owned()
    };
    writeln!(out, "{}", line(headers.iter().map(|h| (*h).to_owned()).collect()))?;
    writeln!(out, "{}", line(widths.iter().map(|w| "-".repeat(*w)).collect()))?;
    for row in rows {
        writeln!(out, "{}", line(row.clone()))?;
    }
    Ok(())
}

fn json_out(out: &mut impl Write, v: &Value) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v)?;
    writeln!(out)?;
    Ok(())
}

/// A record for `list --json` (no bodies) or `show --json` (everything).
fn record_json(r: &Record, now: Millis, full: bool) -> Value {
    let lease_live = r.state == RecordState::InFlight && r.lease_expires_at > now;
    let mut v = json!({
        "account": r.scope.account.as_str(),
        "key": r.scope.key.as_str(),
        "state": state_text(r.state),
        "created_at": time(r.created_at),
        "completed_at": r.completed_at.map(time),
        "lease_expires_at": time(r.lease_expires_at),
        "lease_live": lease_live,
        "fencing_token": r.fencing_token.0,
        "recovery_point": r.recovery_point,
        "last_error": r.last_error,
        "request": {"method": r.request.method, "path": r.request.path},
        "response_status": r.response.as_ref().map(|s| s.status),
    });
    if full {
        v["fingerprint"] = json!(r.fingerprint.to_hex());
        v["step_outputs"] = json!(r.step_outputs);
        v["request"]["headers"] = headers_json(&r.request.headers);
        v["request"]["body"] = json!(body_text(&r.request.body, None));
        v["request"]["body_bytes"] = json!(r.request.body.len());
        v["response"] = match &r.response {
            Some(resp) => json!({
                "status": resp.status,
                "headers": headers_json(&resp.headers),
                "body": body_text(&resp.body, None),
                "body_bytes": resp.body.len(),
            }),
            None => Value::Null,
        };
    }
    v
}

async fn list(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    l: &ListArgs,
) -> anyhow::Result<ExitCode> {
    let filter = ListFilter {
        state: l.state.map(RecordState::from),
        account: l.account.as_deref().map(account_arg),
        limit: l.limit,
    };
    let records = store.list(&filter).await.context("listing records")?;
    let now = store.now();
    if args.json {
        json_out(
            out,
            &json!({"records": records.iter().map(|r| record_json(r, now, false)).collect::<Vec<_>>()}),
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                account_text(&r.scope.account),
                r.scope.key.as_str().to_owned(),
                state_text(r.state).to_owned(),
                time_s(r.created_at),
                lease_text(r, now),
                r.fencing_token.0.to_string(),
                or_dash(r.recovery_point.as_deref()),
                cut(&or_dash(r.last_error.as_deref()), 60),
            ]
        })
        .collect();
    table(
        out,
        &[
            "account",
            "key",
            "state",
            "created",
            "lease/completed",
            "token",
            "recovery point",
            "last error",
        ],
        &rows,
    )?;
    let what = l.state.map_or("", |s| RecordState::from(s).as_str());
    writeln!(
        out,
        "\n{} {}record(s){}",
        records.len(),
        if what.is_empty() {
            String::new()
        } else {
            format!("{what} ")
        },
        if records.len() == l.limit {
            format!(" (limit {}; raise --limit for more)", l.limit)
        } else {
            String::new()
        }
    )?;
    Ok(ExitCode::SUCCESS)
}

async fn show(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    s: &ScopeArgs,
) -> anyhow::Result<ExitCode> {
    let scope = scope_arg(s)?;
    let Some(r) = store.get(&scope).await.context("reading the record")? else {
        if args.json {
            json_out(out, &json!({"record": null}))?;
        } else {
            writeln!(out, "no record for account {} key {}", s.account, s.key)?;
        }
        return Ok(ExitCode::from(1));
    };
    let now = store.now();
    if args.json {
        json_out(out, &json!({"record": record_json(&r, now, true)}))?;
        return Ok(ExitCode::SUCCESS);
    }
    let field = |out: &mut dyn Write, name: &str, value: String| writeln!(out, "{name:<16}{value}");
    field(out, "account", account_text(&r.scope.account))?;
    field(out, "key", r.scope.key.as_str().to_owned())?;
    field(out, "state", state_text(r.state).to_owned())?;
    field(out, "created", time(r.created_at))?;
    match r.state {
        RecordState::InFlight if r.lease_expires_at > now => {
            field(out, "lease", format!("held until {}", time(r.lease_expires_at)))?
        }
        RecordState::InFlight => field(
            out,
            "lease",
            format!(
                "expired {} (abandoned: the completer or a retry resumes it)",
                time(r.lease_expires_at)
            ),
        )?,
        RecordState::Parked => field(out, "parked", time(r.lease_expires_at))?,
        _ => {}
    }
    if let Some(done) = r.completed_at {
        field(out, "completed", time(done))?;
    }
    field(out, "fencing token", r.fencing_token.0.to_string())?;
    field(out, "fingerprint", r.fingerprint.to_hex())?;
    field(out, "recovery point", or_dash(r.recovery_point.as_deref()))?;
    field(out, "last error", or_dash(r.last_error.as_deref()))?;
    if r.step_outputs.is_empty() {
        field(out, "step outputs", "-".to_owned())?;
    } else {
        writeln!(out, "step outputs")?;
        for (name, value) in &r.step_outputs {
            writeln!(out, "  {}: {}", one_line(name), cut(&value.to_string(), 200))?;
        }
    }
    writeln!(out, "request         {} {}", r.request.method, r.request.path)?;
    for h in &r.request.headers {
        writeln!(
            out,
            "  {}: {}",
            h.name,
            one_line(&String::from_utf8_lossy(&h.value))
        )?;
    }
    writeln!(
        out,
        "  body ({} bytes): {}",
        r.request.body.len(),
        body_text(&r.request.body, Some(BODY_PREVIEW))
    )?;
    match &r.response {
        Some(resp) => {
            writeln!(out, "response        {}", resp.status)?;
            for h in &resp.headers {
                writeln!(
                    out,
                    "  {}: {}",
                    h.name,
                    one_line(&String::from_utf8_lossy(&h.value))
                )?;
            }
            writeln!(
                out,
                "  body ({} bytes): {}",
                resp.body.len(),
                body_text(&resp.body, Some(BODY_PREVIEW))
            )?;
        }
        None => field(out, "response", "-".to_owned())?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The step outputs of `r` that record an external call's intent and no result:
/// calls an earlier attempt may have made.
fn pending_intents(r: &Record) -> Vec<String> {
    r.step_outputs
        .iter()
        .filter(|(_, v)| v.get("intent").is_some() && v.get("done").is_none())
        .map(|(name, _)| name.clone())
        .collect()
}

async fn release(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    a: &ReleaseArgs,
) -> anyhow::Result<ExitCode> {
    let scope = scope_arg(&a.scope)?;
    let now = store.now();
    let before = store.get(&scope).await.context("reading the record")?;
    // Why not, from the record as it is.
    let refused = match &before {
        None => Some("no record with this account and key".to_owned()),
        Some(r) => match r.state {
            RecordState::Completed => Some(
                "completed: its response is replayed until the replay window ends; not released".to_owned(),
            ),
            RecordState::Released => Some("already released".to_owned()),
            RecordState::InFlight if r.lease_expires_at > now => Some(format!(
                "held by a live lease until {}; not released (try again once it has expired)",
                time(r.lease_expires_at)
            )),
            RecordState::InFlight | RecordState::Parked => None,
            other => Some(format!("{}: not released", other.as_str())),
        },
    };
    // The operator says an unfinished call did nothing: discard the progress so
    // the key reruns as a first attempt; otherwise keep it (the rerun resumes).
    let discard = a.downstream_did_nothing && before.as_ref().is_some_and(Record::has_progress);
    let released = match refused {
        Some(_) => false,
        None if discard => store
            .discard_progress(&scope)
            .await
            .context("releasing the record and discarding its progress")?,
        None => store
            .force_release(&scope)
            .await
            .context("releasing the record")?,
    };
    let after = store.get(&scope).await.context("reading the record")?;
    let now = store.now();
    let (state, reason) = match (released, &after) {
        (true, Some(r)) if r.state == RecordState::Released => (
            Some(r.state),
            "released: the next request with this key runs as a first attempt".to_owned(),
        ),
        (true, Some(r)) => {
            let intents = pending_intents(r);
            let point = r.recovery_point.as_deref().unwrap_or_default();
            let mut reason = format!(
                "released to resume: its recorded progress is kept (recovery point `{point}`), so the next \
                 request with this key resumes from it and skips committed phases"
            );
            if !intents.is_empty() {
                reason.push_str(&format!(
                    "; the call of {} has an intent and no result, so a downstream that ignores keys parks \
                     it again instead of being called twice (if the downstream did nothing, release with \
                     --downstream-did-nothing)",
                    intents.join(", ")
                ));
            }
            (Some(r.state), reason)
        }
        (true, None) => (None, "released".to_owned()),
        (false, _) => {
            let reason = match &after {
                None => "no record with this account and key".to_owned(),
                Some(r) => match r.state {
                    RecordState::Completed => {
                        "completed: its response is replayed until the replay window ends; not released"
                            .to_owned()
                    }
                    RecordState::Released => "already released".to_owned(),
                    RecordState::InFlight if r.lease_expires_at > now => format!(
                        "held by a live lease until {}; not released (try again once it has expired)",
                        time(r.lease_expires_at)
                    ),
                    other => format!("{}: not released", other.as_str()),
                },
            };
            (after.as_ref().map(|r| r.state), reason)
        }
    };
    if args.json {
        let kept = released && state == Some(RecordState::InFlight);
        json_out(
            out,
            &json!({
                "account": scope.account.as_str(),
                "key": scope.key.as_str(),
                "released": released,
                "state": state.map(state_text),
                "kept_progress": kept,
                "recovery_point": after.as_ref().filter(|_| kept).and_then(|r| r.recovery_point.clone()),
                "pending_intents": after.as_ref().filter(|_| kept).map(pending_intents).unwrap_or_default(),
                "fencing_token": after.as_ref().map(|r| r.fencing_token.0),
                "reason": reason,
            }),
        )?;
    } else {
        writeln!(
            out,
            "{} {}: {reason}",
            account_text(&scope.account),
            scope.key.as_str()
        )?;
    }
    Ok(if released {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn complete(
    out: &mut impl Write,
    args: &KeysArgs,
    url: &str,
    c: &CompleteArgs,
) -> anyhow::Result<ExitCode> {
    // Keys on Redis: the labels rows live in their own SQL database.
    let (rows, keys) = if StoreKind::of(url) == StoreKind::Redis {
        let rows = c.labels_database_url.clone().context(
            "with a Redis key store, pass --labels-database-url: the labels rows' database \
             (the service's --database-url)",
        )?;
        anyhow::ensure!(
            StoreKind::of(&rows) != StoreKind::Redis,
            "--labels-database-url names the labels rows' SQL database, not Redis"
        );
        (rows, Some(url.to_owned()))
    } else {
        anyhow::ensure!(
            c.labels_database_url.is_none(),
            "--labels-database-url is for a Redis key store; with a SQL key store the labels rows \
             live in --database-url"
        );
        (url.to_owned(), None)
    };
    if is_postgres(&rows) {
        // The pass builds the labels service on the store named by --pg-schema;
        // like every `keys` command it never creates one.
        drop(open_pg(&rows, &args.pg_schema, Access::Write).await?);
    } else if !rows.starts_with("sqlite:") && !std::path::Path::new(&rows).exists() {
        return Err(OpenError::NoSqliteFile(rows).into());
    }
    let idempotency = match &c.config {
        Some(path) => idemkit_tower::config::IdemkitConfig::from_toml(
            &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        )?,
        None => idemkit_labels::docs::default_config(),
    };
    let config = LabelsConfig {
        database: rows,
        keys,
        courier_url: c.courier_url.trim_end_matches('/').to_owned(),
        lease: Duration::from_millis(c.lease_ms),
        // The completer replays with the record's own account; no caller signs in.
        tokens: Default::default(),
        courier_deadline: Duration::from_millis(c.courier_deadline_ms),
        idempotency,
        pg_schema: Some(args.pg_schema.clone()),
    };
    let service = build(config).await.context("building the labels service")?;
    let report = Completer::new(service.keys.clone(), service.router.clone())
        .min_age(Duration::from_millis(c.min_age_ms))
        .batch(c.limit)
        .run_once()
        .await
        .context("running the completer")?;
    if args.json {
        json_out(
            out,
            &json!({
                "found": report.found,
                "completed": report.completed,
                "parked": report.parked,
                "unfinished": report.unfinished.iter().map(|(s, answer)| json!({
                    "account": s.account.as_str(), "key": s.key.as_str(), "answer": answer,
                })).collect::<Vec<_>>(),
            }),
        )?;
    } else {
        writeln!(
            out,
            "completer pass: found {}, completed {}, parked {}, unfinished {}",
            report.found,
            report.completed,
            report.parked,
            report.unfinished.len()
        )?;
        if !report.unfinished.is_empty() {
            let rows: Vec<Vec<String>> = report
                .unfinished
                .iter()
                .map(|(s, answer)| {
                    vec![
                        account_text(&s.account),
                        s.key.as_str().to_owned(),
                        one_line(answer),
                    ]
                })
                .collect();
            writeln!(out)?;
            table(out, &["account", "key", "answer"], &rows)?;
        }
    }
    Ok(if report.unfinished.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn reap(
    out: &mut impl Write,
    args: &KeysArgs,
    store: Arc<dyn KeyStore>,
    r: &ReapArgs,
) -> anyhow::Result<ExitCode> {
    let threshold = r.older_than_hours.map_or(Policy::new().reap_threshold, |h| {
        Duration::from_secs(h.saturating_mul(3600))
    });
    let replay_window = r.replay_window_hours.map_or(Policy::new().replay_window, |h| {
        Duration::from_secs(h.saturating_mul(3600))
    });
    let before = store.now().minus(threshold);
    let report = Reaper::with_threshold(store, threshold, replay_window)?
        .run_once()
        .await
        .context("running the reaper")?;
    if args.json {
        json_out(
            out,
            &json!({
                "before": time(before),
                "deleted": report.deleted,
                "moved_to_review": report.moved_to_review,
            }),
        )?;
    } else {
        writeln!(
            out,
            "reaper pass (records older than {}): deleted {} completed or released, moved {} unfinished to the review list",
            time(before),
            report.deleted,
            report.moved_to_review
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

fn review_json(e: &ReviewEntry) -> Value {
    json!({
        "account": e.scope.account.as_str(),
        "key": e.scope.key.as_str(),
        "state": state_text(e.state),
        "created_at": time(e.created_at),
        "reaped_at": time(e.reaped_at),
        "recovery_point": e.recovery_point,
        "step_outputs": e.step_outputs,
        "last_error": e.last_error,
        "request": {
            "method": e.request.method,
            "path": e.request.path,
            "headers": headers_json(&e.request.headers),
            "body": body_text(&e.request.body, None),
        },
    })
}

async fn review(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    r: &ReviewArgs,
) -> anyhow::Result<ExitCode> {
    let entries = store.review(r.limit).await.context("reading the review list")?;
    if args.json {
        json_out(
            out,
            &json!({"entries": entries.iter().map(review_json).collect::<Vec<_>>()}),
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                account_text(&e.scope.account),
                e.scope.key.as_str().to_owned(),
                state_text(e.state).to_owned(),
                time_s(e.created_at),
                time_s(e.reaped_at),
                or_dash(e.recovery_point.as_deref()),
                format!("{} {}", e.request.method, e.request.path),
                cut(&or_dash(e.last_error.as_deref()), 60),
            ]
        })
        .collect();
    table(
        out,
        &[
            "account",
            "key",
            "state",
            "created",
            "reaped",
            "recovery point",
            "request",
            "last error",
        ],
        &rows,
    )?;
    writeln!(
        out,
        "\n{} entr{} awaiting review",
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" }
    )?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(time(Millis(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(time_s(Millis(1_700_000_000_123)), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn tables_align_and_cells_stay_on_one_line() {
        let mut out = Vec::new();
        table(
            &mut out,
            &["a", "bb"],
            &[vec!["xyz".into(), one_line("1\n2")], vec!["-".into(), "-".into()]],
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a    bb\n---  ---\nxyz  1 2\n-    -\n"
        );
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(body_text(b"abcdef", Some(2)), "ab… (4 more bytes)");
    }

    #[test]
    fn unscoped_account_has_a_name() {
        assert_eq!(account_arg(UNSCOPED_NAME), Account::unscoped());
        assert_eq!(account_text(&Account::unscoped()), UNSCOPED_NAME);
    }
}
