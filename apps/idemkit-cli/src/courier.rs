//! `idemkit courier`: the courier simulator the labels service calls, as its own
//! process (see [`idemkit_labels::courier`] for its routes, faults and counters).

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use idemkit_labels::courier::{Courier, CourierConfig};

const AFTER_HELP: &str = "\
Routes:
  POST /shipments               create a shipment (requires Idempotency-Key; body: a JSON object)
                                -> 201 {\"orderNumber\",\"trackingNumber\",\"shipment\"}; same key -> replay
  GET  /shipments/N/events     tracking events of shipment N
  POST /_faults                 any subset of {\"failNext\":N,\"status\":503} {\"latencyMs\":M}
                                {\"dropResponseAfterCommit\":N} {\"rejectNext\":N} {\"reset\":true}
  GET  /_faults                 the faults in force
  GET  /_stats                  {\"shipments\",\"calls\",\"duplicatesSuppressed\"}

All callers share one key space (the courier has no accounts). Prints
`courier listening on http://ADDR` on stdout once it accepts connections; stops on Ctrl-C
or SIGTERM, finishing calls in flight.

Example:
  idemkit courier --listen 127.0.0.1:4000
  curl -s localhost:4000/shipments -H 'Idempotency-Key: label-42' -d '{\"reference\":\"label-42\"}'";

/// Arguments of `idemkit courier`.
#[derive(Debug, Clone, Args)]
#[command(after_help = AFTER_HELP)]
pub struct CourierArgs {
    /// The address to listen on, e.g. 127.0.0.1:4000 (port 0 picks a free one;
    /// the line printed on start names it).
    #[arg(long, value_name = "ADDR")]
    pub listen: String,

    /// Where shipments and idempotency keys live: postgres://… (schema
    /// idemkit_courier), sqlite://PATH or a file path. Default: a fresh SQLite
    /// file in a new temporary directory, removed on exit.
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

/// Runs the courier until Ctrl-C or SIGTERM.
pub fn run(args: CourierArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let mut config = CourierConfig::default();
        if let Some(url) = args.database_url {
            config = config.with_database_url(url);
        }
        let courier = Courier::open(config).await?;
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        let _ = writeln!(
            std::io::stderr(),
            "courier: shipments and keys in {}",
            courier.database()
        );
        let mut out = std::io::stdout().lock();
        writeln!(out, "courier listening on http://{addr}")?;
        out.flush()?;
        drop(out);
        courier.serve_with_shutdown(listener, shutdown_signal()).await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
