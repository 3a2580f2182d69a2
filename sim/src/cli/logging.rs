//! Where `gpupool-sim`'s own log lines go. `up` and `demo` write them to
//! `RUN_DIR/logs/gpupool-sim.log` (beside the logs of the processes they
//! start), so the terminal shows only what a person needs; `apiserver` and
//! `bench` log to stderr. `RUST_LOG` sets the level either way (default
//! `info`).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;

/// The directory under a run directory holding every log file.
pub const LOG_DIR: &str = "logs";

/// The file `gpupool-sim`'s own log lines go to in `run_dir`.
pub fn log_file(run_dir: &Path) -> PathBuf {
    run_dir.join(LOG_DIR).join("gpupool-sim.log")
}

fn filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
}

/// Colour only for a person at a terminal, and never with `NO_COLOR` set
/// (the operator's and device plugin's policy too).
pub fn colour_on_stderr() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Sends log lines to stderr. A second call (a subscriber is already set)
/// changes nothing.
pub fn to_stderr() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr())
        .try_init();
}

/// Creates `RUN_DIR/logs/` and appends log lines to
/// [`log_file`]`(run_dir)`, without colour. Returns that file.
pub fn to_run_dir(run_dir: &Path) -> anyhow::Result<PathBuf> {
    let dir = run_dir.join(LOG_DIR);
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the log directory {}", dir.display()))?;
    let path = log_file(run_dir);
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open the log file {}", path.display()))?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .try_init();
    Ok(path)
}
