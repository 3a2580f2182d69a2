//! `gpupool-sim up --detach` and `gpupool-sim down`.
//!
//! A detached cluster is an ordinary `gpupool-sim up` started in its own
//! process group (so a Ctrl-C at the terminal does not reach it), with its
//! terminal lines appended to `RUN_DIR/logs/gpupool-sim.stderr`. It is the
//! supervisor: it owns every child, which gets SIGTERM from the kernel if
//! the supervisor dies, even by SIGKILL (see `cluster::processes`). Every
//! `up` writes its pid to `RUN_DIR/gpupool-sim.pid` and removes it on the
//! way out; `down` finds the cluster through that file and stops it with
//! SIGTERM, as Ctrl-C stops a foreground `up`.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::process::{Pid, Signal, kill_process};

use super::logging::LOG_DIR;

/// The file holding the pid of the `up` that runs in a run directory.
pub const PID_FILE: &str = "gpupool-sim.pid";

/// Where a detached `up` appends what a foreground one prints on stderr.
pub const STDERR_FILE: &str = "gpupool-sim.stderr";

/// How long `down` waits for the cluster to stop before it kills it.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// The run directory of `up --detach` and `down` when none is given: one
/// per user under the system temp dir, so that `down` finds what `up
/// --detach` started without being told where.
pub fn default_run_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "gpupool-sim-{}",
        rustix::process::getuid().as_raw()
    ))
}

/// Arguments of `gpupool-sim down`.
#[derive(Debug, clap::Args)]
pub struct DownArgs {
    /// The run directory of the cluster to stop (default: the one `up
    /// --detach` uses without --run-dir).
    #[arg(long, env = "GPUPOOL_SIM_RUN_DIR", value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
}

/// Whether `pid` is a live process: a zombie (state Z) has exited, only
/// its parent's reaping is missing.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|rest| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Whether `pid` runs a `gpupool-sim` binary: a pid file left behind by a
/// killed `up` may name a pid the system has given to something else.
fn is_gpupool_sim(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| {
        exe.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("gpupool-sim"))
    })
}

/// The pid of the `up` running in `run_dir`, if one is.
pub fn running(run_dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(run_dir.join(PID_FILE)).ok()?;
    let pid: u32 = text.trim().parse().ok()?;
    (pid != std::process::id() && alive(pid) && is_gpupool_sim(pid)).then_some(pid)
}

/// Fails when a cluster already runs in `run_dir`: two would share its
/// kubelet sockets and kubeconfig.
pub fn refuse_if_running(run_dir: &Path) -> anyhow::Result<()> {
    match running(run_dir) {
        Some(pid) => anyhow::bail!(
            "a simulated cluster is already running in {} (pid {pid}); stop it with `gpupool-sim down --run-dir {}`",
            run_dir.display(),
            run_dir.display()
        ),
        None => Ok(()),
    }
}

/// The pid file of a running `up`; removes the file when dropped.
#[derive(Debug)]
pub struct PidFile(PathBuf);

impl PidFile {
    /// Writes this process's pid to `RUN_DIR/gpupool-sim.pid`.
    pub fn write(run_dir: &Path) -> anyhow::Result<Self> {
        let path = run_dir.join(PID_FILE);
        std::fs::write(&path, format!("{}\n", std::process::id()))
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `path` made absolute against the current directory, so that a printed
/// `export KUBECONFIG=...` works from anywhere.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The last `lines` lines of `path`, for a failure message.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Starts `gpupool-sim up` (this command line without `--detach`) in the
/// background in `run_dir`, waits until it is ready or fails, and prints
/// the `export KUBECONFIG=...` line (stdout) and how to stop it (stderr).
/// `ready_timeout` bounds the wait for the cluster.
pub fn launch(run_dir: &Path, ready_timeout: Duration) -> anyhow::Result<()> {
    refuse_if_running(run_dir)?;
    let logs = run_dir.join(LOG_DIR);
    std::fs::create_dir_all(&logs)
        .with_context(|| format!("cannot create the log directory {}", logs.display()))?;
    let stderr_path = logs.join(STDERR_FILE);
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&stderr_path)
        .with_context(|| format!("cannot open {}", stderr_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the gpupool-sim binary")?;
    let args: Vec<OsString> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--detach")
        .collect();
    let mut child = {
        use std::os::unix::process::CommandExt;
        Command::new(exe)
            .args(&args)
            // An explicit --run-dir in `args` says the same.
            .env("GPUPOOL_SIM_RUN_DIR", run_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .context("cannot start the background gpupool-sim")?
    };
    let stdout = child
        .stdout
        .take()
        .context("the background gpupool-sim has no stdout")?;
    let (tx, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let mut reader = BufReader::new(stdout);
        let _ = reader.read_line(&mut line);
        let _ = tx.send(line);
    });
    let deadline = Instant::now() + ready_timeout + Duration::from_secs(30);
    let kubeconfig = loop {
        if let Ok(line) = ready.recv_timeout(Duration::from_millis(100)) {
            match line.trim_end().strip_prefix("ready kubeconfig=") {
                Some(path) => break PathBuf::from(path),
                None => {
                    // Gone before it was ready; it says why on its stderr.
                    let _ = child.wait();
                    anyhow::bail!(
                        "the background cluster did not start; {} ends with:\n{}",
                        stderr_path.display(),
                        tail(&stderr_path, 20)
                    );
                }
            }
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "the background cluster was not ready within {} s; {} ends with:\n{}",
                (ready_timeout + Duration::from_secs(30)).as_secs(),
                stderr_path.display(),
                tail(&stderr_path, 20)
            );
        }
    };
    println!("export KUBECONFIG={}", absolute(&kubeconfig).display());
    let run_dir = absolute(run_dir);
    eprintln!(
        "gpupool-sim: cluster running in the background (pid {}); run directory {}, logs in {}",
        child.id(),
        run_dir.display(),
        run_dir.join(LOG_DIR).display()
    );
    eprintln!(
        "gpupool-sim: stop it with `gpupool-sim down --run-dir {}`",
        run_dir.display()
    );
    Ok(())
}

/// Runs `gpupool-sim down`: SIGTERM to the `up` running in the run
/// directory, then waits (at most [`STOP_TIMEOUT`], then SIGKILL) until it
/// has stopped every child and exited.
pub fn down(args: &DownArgs) -> anyhow::Result<()> {
    let run_dir = args.run_dir.clone().unwrap_or_else(default_run_dir);
    let Some(pid) = running(&run_dir) else {
        // A pid file naming a dead process is what a killed `up` leaves.
        let _ = std::fs::remove_file(run_dir.join(PID_FILE));
        anyhow::bail!(
            "no simulated cluster is running in {} (no live gpupool-sim named in {}); start one with `gpupool-sim up --detach --run-dir {}`",
            run_dir.display(),
            run_dir.join(PID_FILE).display(),
            run_dir.display()
        );
    };
    let target = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .context("the pid file names an impossible pid")?;
    kill_process(target, Signal::TERM)
        .with_context(|| format!("cannot signal gpupool-sim (pid {pid})"))?;
    let deadline = Instant::now() + STOP_TIMEOUT;
    while alive(pid) {
        if Instant::now() >= deadline {
            let _ = kill_process(target, Signal::KILL);
            anyhow::bail!(
                "the cluster in {} did not stop within {} s of SIGTERM; killed it (pid {pid}); its children get SIGTERM from the kernel",
                run_dir.display(),
                STOP_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("gpupool-sim: stopped the cluster in {}", run_dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_file_naming_no_gpupool_sim_is_not_a_running_cluster() {
        let dir = tempfile::tempdir().expect("dir");
        assert_eq!(running(dir.path()), None, "no pid file");
        std::fs::write(dir.path().join(PID_FILE), "not a pid").expect("write");
        assert_eq!(running(dir.path()), None, "garbage");
        // pid 1 is alive but is not gpupool-sim.
        std::fs::write(dir.path().join(PID_FILE), "1\n").expect("write");
        assert_eq!(running(dir.path()), None, "another program");
        refuse_if_running(dir.path()).expect("nothing runs there");
    }

    #[test]
    fn the_pid_file_goes_with_its_owner() {
        let dir = tempfile::tempdir().expect("dir");
        let file = PidFile::write(dir.path()).expect("written");
        let text = std::fs::read_to_string(dir.path().join(PID_FILE)).expect("read");
        assert_eq!(text.trim(), std::process::id().to_string());
        // This process is not `gpupool-sim` under test, and is never its own other cluster.
        assert_eq!(running(dir.path()), None);
        drop(file);
        assert!(!dir.path().join(PID_FILE).exists());
    }

    #[test]
    fn down_names_the_run_dir_when_nothing_runs_there() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join(PID_FILE), "1\n").expect("write");
        let err = down(&DownArgs {
            run_dir: Some(dir.path().to_path_buf()),
        })
        .expect_err("nothing to stop");
        let message = err.to_string();
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        assert!(
            !dir.path().join(PID_FILE).exists(),
            "stale pid file removed"
        );
    }
}
