//! Child processes of the simulated cluster: the real `gpupool-device-plugin`
//! and `gpupool-operator` binaries, each with its own log file in the run
//! directory.
//!
//! No orphans: every child is started under `setpriv --pdeathsig TERM`
//! (util-linux), so the kernel sends it SIGTERM when the process that started
//! it dies, even by SIGKILL. Without `setpriv` the children are still
//! stopped on every orderly exit (and killed when their handle is dropped),
//! and a warning says that a SIGKILL of the simulator would leave them
//! running.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process};
use tokio::process::{Child, Command};

/// The command that builds every binary the simulator runs.
pub const BUILD_COMMAND: &str = "cargo build --workspace --bins";

/// Where `setpriv` is looked for.
const SETPRIV: [&str; 2] = ["/usr/bin/setpriv", "/bin/setpriv"];

/// Why a child process could not be found, started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The binary is not where the simulator looks for it.
    #[error(
        "cannot find the {name} binary (looked for {}); build it with `{BUILD_COMMAND}` or pass {flag} PATH",
        searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    MissingBinary {
        /// Binary name.
        name: String,
        /// Flag that names it explicitly.
        flag: String,
        /// Paths tried.
        searched: Vec<PathBuf>,
    },
    /// The log file could not be opened.
    #[error("cannot open log file {path}: {source}")]
    Log {
        /// Log path.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The process could not be started.
    #[error("cannot start {name} ({program}): {source}")]
    Spawn {
        /// Process name.
        name: String,
        /// Program path.
        program: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// Waiting for or signalling the process failed.
    #[error("cannot stop {name}: {source}")]
    Stop {
        /// Process name.
        name: String,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Finds binary `name`: `explicit` if given (it must exist), else next to
/// the running executable, or one directory up when that is a test binary
/// in `target/<profile>/deps`.
pub fn find_binary(
    name: &str,
    flag: &str,
    explicit: Option<&Path>,
) -> Result<PathBuf, ProcessError> {
    let mut searched = Vec::new();
    if let Some(path) = explicit {
        if path.is_file() {
            return Ok(path.to_path_buf());
        }
        searched.push(path.to_path_buf());
    } else if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        let mut dirs = vec![dir.to_path_buf()];
        if dir.file_name().is_some_and(|n| n == "deps")
            && let Some(up) = dir.parent()
        {
            dirs.push(up.to_path_buf());
        }
        for d in dirs {
            let candidate = d.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
            searched.push(candidate);
        }
    }
    Err(ProcessError::MissingBinary {
        name: name.to_owned(),
        flag: flag.to_owned(),
        searched,
    })
}

/// How to start one child.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    /// Short name: names the log file (`<name>.log`) and appears in messages.
    pub name: String,
    /// The binary.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment variables.
    pub env: Vec<(OsString, OsString)>,
}

/// A running (or exited) child. Dropping it kills the process.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    pid: Option<u32>,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

fn setpriv() -> Option<&'static str> {
    SETPRIV.into_iter().find(|p| Path::new(p).is_file())
}

impl ChildProcess {
    /// Starts the process with stdout and stderr appended to
    /// `<log_dir>/<name>.log`, stdin closed; it gets SIGTERM when the
    /// simulator dies.
    pub fn spawn(spec: &ProcessSpec, log_dir: &Path) -> Result<Self, ProcessError> {
        Self::spawn_with_death_signal(spec, log_dir, "TERM")
    }

    /// Like [`ChildProcess::spawn`], with the signal (`TERM`, `KILL`) the
    /// kernel sends the child when the simulator dies. `KILL` is for
    /// children whose orderly shutdown can wait forever on a sibling that
    /// died with the simulator (kube-apiserver on its etcd).
    pub fn spawn_with_death_signal(
        spec: &ProcessSpec,
        log_dir: &Path,
        signal: &str,
    ) -> Result<Self, ProcessError> {
        let log = log_dir.join(format!("{}.log", spec.name));
        let open = || {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|source| ProcessError::Log {
                    path: log.clone(),
                    source,
                })
        };
        let (stdout, stderr) = (open()?, open()?);
        let mut command = match setpriv() {
            Some(setpriv) => {
                let mut c = Command::new(setpriv);
                c.arg("--pdeathsig")
                    .arg(signal)
                    .arg("--")
                    .arg(&spec.program);
                c
            }
            None => {
                tracing::warn!(process = %spec.name, "setpriv not found: if gpupool-sim is killed with SIGKILL this child keeps running");
                Command::new(&spec.program)
            }
        };
        command
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        let child = command.spawn().map_err(|source| ProcessError::Spawn {
            name: spec.name.clone(),
            program: spec.program.clone(),
            source,
        })?;
        let pid = child.id();
        tracing::info!(process = %spec.name, pid, log = %log.display(), "started");
        Ok(Self {
            name: spec.name.clone(),
            child,
            pid,
            log,
            exited: None,
        })
    }

    /// The process name given at start.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// OS process id (while it has not been reaped).
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The exit status once it has exited, without waiting.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            self.exited = Some(status);
        }
        self.exited
    }

    /// Sends SIGTERM, waits up to `grace` for the process to exit, then
    /// kills it. Returns its exit status.
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus, ProcessError> {
        if let Some(status) = self.exit_status() {
            return Ok(status);
        }
        let stop_error = |source| ProcessError::Stop {
            name: self.name.clone(),
            source,
        };
        if let Some(pid) = self
            .pid
            .and_then(|p| i32::try_from(p).ok())
            .and_then(Pid::from_raw)
        {
            // The process may exit between the check above and the signal.
            let _ = kill_process(pid, Signal::TERM);
        }
        let status = match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.map_err(stop_error)?,
            Err(_) => {
                tracing::warn!(process = %self.name, ?grace, "did not exit after SIGTERM; killing it");
                self.child.kill().await.map_err(stop_error)?;
                self.child.wait().await.map_err(stop_error)?
            }
        };
        tracing::info!(process = %self.name, %status, "stopped");
        self.exited = Some(status);
        Ok(status)
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub async fn kill(&mut self) -> Result<ExitStatus, ProcessError> {
        if let Some(status) = self.exit_status() {
            return Ok(status);
        }
        let stop_error = |source| ProcessError::Stop {
            name: self.name.clone(),
            source,
        };
        self.child.kill().await.map_err(stop_error)?;
        let status = self.child.wait().await.map_err(stop_error)?;
        self.exited = Some(status);
        Ok(status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_names_the_build_command_and_the_flag() {
        let err = find_binary("no-such-binary", "--x-bin", None).expect_err("absent");
        let msg = err.to_string();
        assert!(
            msg.contains("no-such-binary")
                && msg.contains(BUILD_COMMAND)
                && msg.contains("--x-bin"),
            "{msg}"
        );
        let err =
            find_binary("x", "--x-bin", Some(Path::new("/nonexistent/x"))).expect_err("absent");
        assert!(err.to_string().contains("/nonexistent/x"), "{err}");
    }

    #[tokio::test]
    async fn children_log_and_stop_on_sigterm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = ProcessSpec {
            name: "sleeper".into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo hello; exec sleep 30".into()],
            env: Vec::new(),
        };
        let mut child = ChildProcess::spawn(&spec, dir.path()).expect("spawns");
        assert!(child.pid().is_some());
        assert_eq!(child.exit_status(), None);
        // Give the shell a moment to write its line (bounded).
        for _ in 0..100 {
            if std::fs::read_to_string(child.log())
                .unwrap_or_default()
                .contains("hello")
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            std::fs::read_to_string(child.log())
                .expect("log")
                .contains("hello")
        );
        let status = child.stop(Duration::from_secs(5)).await.expect("stops");
        assert!(!status.success(), "killed by SIGTERM: {status}");
    }

    #[tokio::test]
    async fn spawning_a_missing_program_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = ProcessSpec {
            name: "ghost".into(),
            program: "/nonexistent/ghost".into(),
            args: Vec::new(),
            env: Vec::new(),
        };
        // Under setpriv the exec failure is the child's exit code, not a spawn error.
        match ChildProcess::spawn(&spec, dir.path()) {
            Err(e) => assert!(e.to_string().contains("ghost"), "{e}"),
            Ok(mut child) => {
                let status = child.stop(Duration::from_secs(5)).await.expect("exits");
                assert!(!status.success());
            }
        }
    }
}
