//! `kubectl-gpupool`: the binary kubectl runs for `kubectl gpupool …`.
//!
//! Exit status: 0 on success, 2 for bad flags (with clap's usage text), 1
//! for any other error. Every error is one line on stderr after the prefix
//! `kubectl-gpupool: `.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use kubectl_gpupool::cli::Cli;
use kubectl_gpupool::style::Style;
use kubectl_gpupool::{Error, run};

const PREFIX: &str = "kubectl-gpupool: ";

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version: clap's text on stdout, success.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text);
            eprint!("{PREFIX}{text}");
            return ExitCode::from(2);
        }
    };
    let style = Style::detect(
        std::io::stdout().is_terminal(),
        std::env::var("NO_COLOR").ok().as_deref(),
        std::env::var("TERM").ok().as_deref(),
    );
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{PREFIX}cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    match runtime.block_on(run(cli, style, &mut stdout)) {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is the reader's choice, not a failure.
        Err(Error::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{PREFIX}{e}");
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
        }
    }
}
