//! The host operations real nodes need: running `ip`, `iptables` and `ctr`,
//! cgroups for each kubelet, and finding what a node left behind (mounts,
//! containerd shims) so teardown removes exactly that.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use tokio::process::Command;

use super::RealNodeError;

/// Runs `program args`, returning its stdout; a failure names `step`.
pub async fn run<I, S>(step: &str, program: &str, args: I) -> Result<String, RealNodeError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args
        .into_iter()
        .map(|a| a.as_ref().to_os_string())
        .collect();
    let command_line = std::iter::once(program.to_owned())
        .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ");
    let output = Command::new(program)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| RealNodeError::Command {
            step: step.to_owned(),
            command: command_line.clone(),
            status: "not started".to_owned(),
            stderr: e.to_string(),
        })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(RealNodeError::Command {
            step: step.to_owned(),
            command: command_line,
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// Runs a command whose failure teardown logs and goes past: what it
/// removes may already be gone, and the rest must still be removed.
pub async fn run_for_teardown<I, S>(step: &str, program: &str, args: I)
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    if let Err(e) = run(step, program, args).await {
        tracing::warn!(error = %e, "teardown step failed; going on");
    }
}

/// Fails naming the first tool of `tools` not on the PATH, and when not root.
pub fn check_prerequisites(tools: &[(&str, &str)]) -> Result<(), RealNodeError> {
    if !rustix::process::geteuid().is_root() {
        return Err(RealNodeError::NotRoot);
    }
    for (tool, package) in tools {
        if find_on_path(tool).is_none() {
            return Err(RealNodeError::MissingTool {
                tool: (*tool).to_owned(),
                hint: format!("Debian package {package}"),
            });
        }
    }
    Ok(())
}

/// `name` found in a directory of `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The cgroup hierarchies to make a kubelet's cgroup root in: every v1
/// controller mount under `/sys/fs/cgroup` (not the `unified` v2 mount a
/// hybrid host adds), or `/sys/fs/cgroup` itself on a v2-only host.
pub fn cgroup_hierarchies() -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").is_file() {
        return vec![base.to_path_buf()];
    }
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name() != "unified")
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Where a hybrid cgroup v1 host mounts its cgroup v2 hierarchy: the
/// kubelet leaves it alone, but runc makes each container's cgroup there
/// too (empty once the container is gone), under the node's cgroup root.
pub const UNIFIED_HIERARCHY: &str = "/sys/fs/cgroup/unified";

/// The cgroup `name` in the hybrid host's cgroup v2 hierarchy, when it
/// exists: removed with the node's own cgroups.
pub fn unified_cgroup(name: &std::ffi::OsStr) -> Option<PathBuf> {
    let dir = Path::new(UNIFIED_HIERARCHY).join(name);
    dir.is_dir().then_some(dir)
}

/// Removes the cgroup `dir` and every cgroup under it, deepest first (a
/// cgroup is removed with rmdir, and only once it has no children).
pub fn remove_cgroup_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&entry.path());
        }
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove cgroup");
    }
}

/// SIGKILLs every process in the cgroup `dir` and the cgroups under it.
pub fn kill_cgroup_tree(dir: &Path) {
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            kill_cgroup_tree(&entry.path());
        }
    }
}

/// Mount points at or under `dir`, deepest first, from `/proc/self/mountinfo`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    found
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        if bytes[i] == b'\\'
            && let Some(v) = octal
        {
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    PathBuf::from(String::from_utf8_lossy(&out).into_owned())
}

/// PIDs of processes whose command line holds `needle` as one argument:
/// the containerd shims of one node carry its socket address, which no
/// other node's do.
pub fn pids_with_argument(needle: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| cmdline.split(|b| *b == 0).any(|a| a == needle.as_bytes()))
        })
        .collect()
}

/// PIDs of processes with an argument that names a path under `dir` (as
/// `-address <dir>/…/containerd.sock` does for a node's shims).
pub fn pids_with_argument_under(dir: &str) -> Vec<i32> {
    let prefix = format!("{}/", dir.trim_end_matches('/'));
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|b| *b == 0)
                    .any(|a| a.starts_with(prefix.as_bytes()))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(
            unescape_mount_path(r"/tmp/a\040b\134c"),
            PathBuf::from(r"/tmp/a b\c")
        );
        assert_eq!(unescape_mount_path("/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape_mount_path(r"/end\04"), PathBuf::from(r"/end\04"));
    }

    #[tokio::test]
    async fn a_failing_command_names_its_step_and_stderr() {
        let err = run("listing a missing directory", "ls", ["/nonexistent-dir"])
            .await
            .expect_err("ls of a missing directory fails");
        let msg = err.to_string();
        assert!(
            msg.contains("listing a missing directory")
                && msg.contains("ls /nonexistent-dir")
                && msg.contains("No such file"),
            "{msg}"
        );
        let err = run("a missing program", "/nonexistent/prog", ["x"])
            .await
            .expect_err("no such program");
        assert!(err.to_string().contains("not started"), "{err}");
    }

    #[test]
    fn this_process_is_found_by_its_own_argument() {
        let me = std::process::id() as i32;
        let arg0 = std::env::args().next().expect("argv[0]");
        assert!(pids_with_argument(&arg0).contains(&me));
        assert!(!pids_with_argument("no-process-has-this-argument-4f1c").contains(&me));
    }
}
