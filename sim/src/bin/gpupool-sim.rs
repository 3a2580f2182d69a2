//! `gpupool-sim`: the local simulated cluster (DESIGN §7).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpupool_sim::cli;

/// Runs gpupool on a simulated cluster on this machine.
#[derive(Debug, Parser)]
#[command(name = "gpupool-sim", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start only the in-memory API server and write a kubeconfig for it.
    Apiserver(cli::apiserver::Args),
    /// Start the whole cluster (API server, scheduler, kubelets, the real binaries).
    Up(cli::up::Args),
    /// Start the cluster, run a scripted scenario and show the queue move.
    Demo(cli::demo::Args),
    /// Push many pods through the cluster and print performance figures as JSON.
    Bench(cli::bench::Args),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpupool-sim: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Apiserver(args) => cli::apiserver::run(args).await,
            Command::Up(args) => cli::up::run(args).await,
            Command::Demo(args) => cli::demo::run(args).await,
            Command::Bench(args) => cli::bench::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpupool-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}
