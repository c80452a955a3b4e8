//! `ratelimit-gateway`: parses flags, sets up logging, serves until SIGTERM or SIGINT.

use std::io::IsTerminal;

use clap::Parser;
use ratelimit_gateway::{Args, Config};
use tracing_subscriber::EnvFilter;

/// mimalloc: per-thread free lists with no arena lock and no consolidation
/// pass; each check allocates and frees a few dozen small blocks (request,
/// keys, Redis reply, answer) and hyper's 8 KiB read buffers.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// The runtime of the signals and the reload tasks; requests are served on
// `--worker-threads` threads of their own (`ratelimit_gateway::run`).
#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = match Config::try_from(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ratelimit-gateway: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match ratelimit_gateway::run(config, shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "ratelimit-gateway failed");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    let int = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM: shutting down"),
        _ = int => tracing::info!("SIGINT: shutting down"),
    }
}
