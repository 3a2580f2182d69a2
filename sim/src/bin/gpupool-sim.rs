//! `gpupool-sim`: the local simulated cluster (DESIGN §7).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpupool_sim::cli;

/// Runs gpupool on a simulated cluster on this machine.
#[derive(Debug, Parser)]
#[command(
    name = "gpupool-sim",
    version,
    about = "A Kubernetes cluster with gpupool on it, simulated on this machine: no cluster or GPU needed.\nNew here? Run `gpupool-sim demo`; `gpupool-sim up` then gives you a cluster for kubectl."
)]
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
    /// Stop a cluster started with `up --detach`.
    Down(cli::detach::DownArgs),
    /// Start here: a short story on 2 nodes × 2 GPUs (primaries queue, helpers fill idle GPUs and are preempted).
    Demo(cli::demo::Args),
    /// Push many pods through the cluster and print performance figures as JSON.
    Bench(cli::bench::Args),
    /// Time the queue's hand-over on a real node (root, containerd, the
    /// chart's images) and print the figures as JSON.
    BenchNode(cli::bench_node::Args),
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
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, said once, as the operator and device plugin do.
            eprintln!("gpupool-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Sends logs where the command wants them and runs it.
fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Down(args) => cli::detach::down(&args),
        Command::Up(mut args) => {
            let run_dir = args.resolved_run_dir();
            if args.detach {
                return cli::detach::launch(&run_dir, args.ready_timeout());
            }
            cli::logging::to_run_dir(&run_dir)?;
            args.run_dir = Some(run_dir);
            runtime()?.block_on(cli::up::run(args))
        }
        Command::Demo(mut args) => {
            let run_dir = args.resolved_run_dir();
            cli::logging::to_run_dir(&run_dir)?;
            args.run_dir = Some(run_dir);
            runtime()?.block_on(cli::demo::run(args))
        }
        Command::Apiserver(args) => {
            cli::logging::to_stderr();
            runtime()?.block_on(cli::apiserver::run(args))
        }
        Command::Bench(args) => {
            cli::logging::to_stderr();
            runtime()?.block_on(cli::bench::run(args))
        }
        Command::BenchNode(args) => {
            cli::logging::to_stderr();
            runtime()?.block_on(cli::bench_node::run(args))
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Runtime::new()
        .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))
}
