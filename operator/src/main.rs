//! `gpupool-operator`: parses flags, starts the watches, the decision loop,
//! leader election, the webhook and the metrics server, and maps the outcome
//! to exit codes (0 on SIGTERM/SIGINT, 2 on bad flags, 1 on a fatal error).

use std::process::ExitCode;

use clap::Parser;
use gpupool_operator::config::Args;

#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

fn main() -> ExitCode {
    // Written to dhat-heap.json in the working directory when main returns;
    // deep stacks, as serde's nesting otherwise hides which object allocated.
    #[cfg(feature = "dhat-heap")]
    let _profiler = dhat::Profiler::builder().trim_backtraces(Some(64)).build();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let config = match args.validate() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpupool-operator: {e}");
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
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpupool-operator: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(gpupool_operator::app::run(config)) {
        Ok(()) => {
            tracing::info!("shut down");
            ExitCode::SUCCESS
        }
        Err(e) => {
            // One line, said once (not as a log line and again as text).
            eprintln!("gpupool-operator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn colour_on_stderr() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
