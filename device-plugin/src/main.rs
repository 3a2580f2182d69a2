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
    // clap prints its own error naming the flag (exit 2), or --help and
    // --version (exit 0), before anything else is set up.
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let settings = match args.validate() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("gpupool-device-plugin: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: `kubectl logs` and log
        // files get plain text, and NO_COLOR is honoured.
        .with_ansi(colour_on_stderr())
        .init();
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = if e.is_config_error() { 2 } else { 1 };
            // One line, said once (not as a log line and again as text).
            eprintln!("gpupool-device-plugin: {e}");
            ExitCode::from(code)
        }
    }
}

fn colour_on_stderr() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
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
