//! `gpupool-device-plugin`: the kubelet device plugin binary.
//!
//! Exit codes: 0 after SIGTERM/SIGINT, 2 for bad flags or configuration,
//! 1 for any other fatal error.

use std::process::ExitCode;

use clap::Parser;
use gpupool_device_plugin::app;
use gpupool_device_plugin::cli::Args;
use gpupool_device_plugin::metrics::Metrics;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    // clap prints the error naming the flag and exits 2 (0 for --help).
    let settings = match Args::parse().validate() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = if e.is_config_error() { 2 } else { 1 };
            tracing::error!(error = %e, "gpupool-device-plugin stopped");
            eprintln!("error: {e}");
            ExitCode::from(code)
        }
    }
}

fn run(settings: gpupool_device_plugin::cli::Settings) -> Result<(), app::AppError> {
    let metrics = Metrics::new();
    let table = app::start_discovery(&settings, &metrics)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(app::AppError::Runtime)?;
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        let signals = shutdown.clone();
        let mut term = signal(SignalKind::terminate());
        let mut int = signal(SignalKind::interrupt());
        tokio::spawn(async move {
            match (&mut term, &mut int) {
                (Ok(term), Ok(int)) => {
                    tokio::select! {
                        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
                    }
                }
                _ => {
                    tracing::error!("cannot install signal handlers; stop with SIGKILL");
                    return;
                }
            }
            signals.cancel();
        });
        app::run(settings, table, metrics, shutdown).await
    })
}
