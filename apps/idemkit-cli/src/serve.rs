//! `idemkit serve`: the shipping-label reference service.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use axum::response::IntoResponse;
use idemkit_labels::service::{LabelsConfig, build};
use idemkit_tower::{Completer, Reaper};

/// Arguments of `idemkit serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on, e.g. `127.0.0.1:8080`.
    #[arg(long)]
    pub listen: SocketAddr,
    /// A listener of its own for the gRPC API (`labels.v1.Labels` and server
    /// reflection), e.g. `127.0.0.1:50051`. Without it, gRPC is served on
    /// `--listen` beside REST (multiplexed by path; clients use HTTP/2 without
    /// TLS, as `grpcurl -plaintext` does). With keys in Redis (`--keys-url`)
    /// only REST is served.
    #[arg(long)]
    pub grpc_listen: Option<SocketAddr>,
    /// `postgres://…`, `sqlite://…` or a SQLite file path (default `labels.db`):
    /// the labels rows and the keys. A `redis://…` or `redis+cluster://…` URL
    /// here is the key store, and the labels rows go to
    /// `IDEMKIT_ROWS_DATABASE_URL` (default the SQLite file `labels.db`), as
    /// with `--keys-url`.
    #[arg(long)]
    pub database_url: Option<String>,
    /// Keep the idempotency keys in Redis (`redis://…`, `redis+cluster://…`; a
    /// `?prefix=` parameter namespaces them) while the labels rows stay in
    /// `--database-url` (SQLite or PostgreSQL). The completer and the reaper run
    /// on this store. Without it, the keys live with the labels rows.
    #[arg(long, env = "IDEMKIT_KEYS_URL")]
    pub keys_url: Option<String>,
    /// The courier's base URL (run one with `idemkit courier`).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub courier_url: String,
    /// Lease of a label request, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Deadline of the courier call, retries included, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub courier_deadline_ms: u64,
    /// A file of `token=account` lines (or comma-separated entries; `#` starts a
    /// comment line). Without it, `IDEMKIT_TOKENS="token=account,…"`. Each entry
    /// splits at its last `=`, so tokens may end in base64 padding
    /// (`dG9rZW4==acme` is token `dG9rZW4=` for account `acme`); accounts cannot
    /// contain `=`. Without tokens the service refuses to start unless
    /// `--demo-tokens` is given.
    #[arg(long, value_name = "FILE")]
    pub tokens: Option<PathBuf>,
    /// Accept the public demo tokens (`demo-token-acme` → `acme`,
    /// `demo-token-globex` → `globex`). For demos and tests only: anyone who has
    /// read the docs can use them. Not combinable with `--tokens` or `IDEMKIT_TOKENS`.
    #[arg(long)]
    pub demo_tokens: bool,
    /// The idempotency configuration (TOML); default: the service's own `idemkit.toml`.
    #[arg(long, env = "IDEMKIT_CONFIG")]
    pub config: Option<PathBuf>,
}

/// The bearer tokens the service accepts: `--tokens`, else `IDEMKIT_TOKENS`, else
/// the demo tokens if `--demo-tokens` asks for them; with none of these, an error.
fn tokens(args: &ServeArgs) -> anyhow::Result<HashMap<String, String>> {
    let configured = match (&args.tokens, std::env::var("IDEMKIT_TOKENS")) {
        (Some(path), _) => Some(
            LabelsConfig::parse_tokens(
                &std::fs::read_to_string(path)
                    .with_context(|| format!("reading the token file {}", path.display()))?,
            )
            .with_context(|| format!("the token file {}", path.display()))?,
        ),
        (None, Ok(spec)) if !spec.trim().is_empty() => {
            Some(LabelsConfig::parse_tokens(&spec).context("IDEMKIT_TOKENS")?)
        }
        _ => None,
    };
    match (configured, args.demo_tokens) {
        (Some(tokens), false) => Ok(tokens),
        (None, true) => Ok(LabelsConfig::demo_tokens()),
        (Some(_), true) => anyhow::bail!(
            "--demo-tokens cannot be combined with configured tokens (--tokens or IDEMKIT_TOKENS)"
        ),
        (None, false) => anyhow::bail!(
            "no API tokens configured, refusing to start: pass --tokens <FILE> (lines of \
             `token=account`) or set IDEMKIT_TOKENS=\"token=account,…\"; to accept the public \
             demo tokens (demo-token-acme, demo-token-globex), pass --demo-tokens"
        ),
    }
}

/// A gRPC `UNIMPLEMENTED` answer (trailers-only) for a method the gRPC
/// listener does not serve.
fn tonic_unimplemented() -> axum::response::Response {
    (
        [
            ("content-type", "application/grpc"),
            ("grpc-status", "12"),
            ("grpc-message", "no such method"),
        ],
        "",
    )
        .into_response()
}

/// Where the labels rows and the keys live. A Redis `--database-url` (without
/// `--keys-url`) is the key store; the labels rows, which need SQL, go to
/// `IDEMKIT_ROWS_DATABASE_URL`, else the SQLite file `labels.db`.
fn stores(database_url: Option<String>, keys_url: Option<String>) -> (String, Option<String>) {
    let keys = keys_url.filter(|k| !k.is_empty());
    match database_url {
        Some(url) if keys.is_none() && idemkit::StoreKind::of(&url) == idemkit::StoreKind::Redis => {
            let rows = std::env::var("IDEMKIT_ROWS_DATABASE_URL")
                .ok()
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| "labels.db".into());
            (rows, Some(url))
        }
        database_url => (database_url.unwrap_or_else(|| "labels.db".into()), keys),
    }
}

/// Runs the service until interrupted.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    crate::install_crash_point();
    let tokens = tokens(&args)?;
    let lease = Duration::from_millis(args.lease_ms);
    let (database, keys) = stores(args.database_url, args.keys_url);
    let config = LabelsConfig {
        database,
        keys,
        courier_url: args.courier_url.trim_end_matches('/').to_owned(),
        lease,
        tokens,
        courier_deadline: Duration::from_millis(args.courier_deadline_ms),
        idempotency: match &args.config {
            Some(path) => idemkit_tower::config::IdemkitConfig::from_toml(
                &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
            )?,
            None => idemkit_labels::contract::default_config(),
        },
        pg_schema: None,
    };
    let reap_threshold = config.idempotency.defaults.reap_threshold;
    let replay_window = config.idempotency.defaults.replay_window;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        // One recorder per process, rendered at `GET /metrics` (docs/metrics.md).
        crate::install_metrics()?;
        let service = build(config).await?;
        // Abandoned requests are finished without waiting for the client; records
        // past the reap threshold go (unfinished ones to the review table).
        let every = (lease * 2).max(Duration::from_millis(200));
        Completer::new(service.keys.clone(), service.router.clone())
            .min_age(lease)
            .spawn(every);
        Reaper::with_threshold(service.keys.clone(), reap_threshold, replay_window)?
            .spawn(Duration::from_secs(3600));
        if let Some(addr) = args.grpc_listen {
            let grpc = service.grpc.clone().context(
                "--grpc-listen: gRPC is served only with the keys in the labels rows' database (no --keys-url)",
            )?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            println!("labels gRPC listening on {}", listener.local_addr()?);
            let grpc = grpc.fallback(|| async { tonic_unimplemented() });
            tokio::spawn(async move { axum::serve(listener, grpc).await });
        }
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        println!("labels listening on http://{}", listener.local_addr()?);
        axum::serve(listener, service.router)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}
