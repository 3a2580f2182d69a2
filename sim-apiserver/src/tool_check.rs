//! What a test does when a tool it needs is missing (helm, kubectl, a real
//! control plane's binaries, root, the images), written once for every
//! suite of the workspace that uses it:
//!
//! - in CI (`CI` set and not empty; `.ci/run` sets it and installs every
//!   tool) it fails, naming what is missing, so a broken install step
//!   cannot pass unnoticed;
//! - elsewhere it prints `skipping <test>: <what>` (which `cargo test`
//!   shows only for a failing test) and appends the tool's name to this
//!   `cargo test` run's skip record, for the caller to return without
//!   checking anything. The last suite of `gpupool-sim-apiserver`
//!   (`tests/skipped_tests.rs`) prints the record as one line, past
//!   libtest's capture: `skipped 8 tests for want of: KUBEBUILDER_ASSETS
//!   (5), helm (3)`.
//!
//! A run's record is `<target>/<profile>/gpupool-skipped/<run>`, where
//! `<run>` names the process that started the test binaries (`cargo test`)
//! by its pid and start time, so each run counts its own skips and no step
//! has to clear the record first.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// The environment variable CI sets.
pub const CI_ENV: &str = "CI";

/// The directory, next to the test binaries' `deps/`, holding each run's
/// skip record.
pub const RECORD_DIR: &str = "gpupool-skipped";

/// Whether this is a CI run (`CI` set and not empty).
pub fn in_ci() -> bool {
    std::env::var_os(CI_ENV).is_some_and(|v| !v.is_empty())
}

/// Reports that `tool` (a short name: `helm`, `kubectl`,
/// `KUBEBUILDER_ASSETS`, `root`…) is missing for `test`, `what` saying so
/// and how to get it: panics in CI; otherwise prints
/// `skipping <test>: <what>` and records the skip, for the caller to return
/// without checking anything.
pub fn missing(test: &str, tool: &str, what: &str) {
    match verdict(in_ci(), test, what) {
        Ok(line) => {
            eprintln!("{line}");
            record(tool, test);
        }
        Err(failure) => panic!("{failure}"),
    }
}

/// The directory in the environment variable `var` when set and not empty;
/// otherwise `None` after [`missing`] has said that `var` is not set
/// (`how` saying how to get it) for `test`.
pub fn env_dir(test: &str, var: &str, how: &str) -> Option<PathBuf> {
    let found = std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    if found.is_none() {
        missing(test, var, &format!("{var} is not set ({how})"));
    }
    found
}

/// The environment variable naming a real control plane's binaries (etcd,
/// kube-apiserver…), as envtest names it.
pub const KUBE_ASSETS_ENV: &str = "KUBEBUILDER_ASSETS";

/// The directory in [`KUBE_ASSETS_ENV`], or `None` after [`missing`] has
/// said it is not set, for `test`, which needs a real control plane.
pub fn kube_assets(test: &str) -> Option<PathBuf> {
    env_dir(
        test,
        KUBE_ASSETS_ENV,
        "bash .ci/install-k8s.sh prepares a real control plane",
    )
}

/// Whether `program` runs with `args` and succeeds (for example `kubectl
/// version --client`); when it does not, `false` after [`missing`] has said
/// so for `test`.
pub fn runs(test: &str, program: &str, args: &[&str]) -> bool {
    let what = match std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => return true,
        Ok(out) => format!("`{program} {}` fails ({})", args.join(" "), out.status),
        Err(_) => format!("{program} is not on the PATH"),
    };
    missing(test, program, &what);
    false
}

/// This run's skips as one line, or `None` when nothing was skipped; the
/// record is removed, and with it any other run's older than a day.
pub fn take_summary() -> Option<String> {
    let dir = record_dir();
    let path = dir.join(run_name());
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    prune(&dir, Duration::from_secs(24 * 3600));
    summary_line(&text)
}

/// The skip line, or in CI the failure.
fn verdict(ci: bool, test: &str, what: &str) -> Result<String, String> {
    if ci {
        Err(format!(
            "{CI_ENV} is set, so {test} may not skip, yet {what}"
        ))
    } else {
        Ok(format!("skipping {test}: {what}"))
    }
}

/// Appends `tool<TAB>binary::test` to this run's record. A record that
/// cannot be written loses only the summary's count, never the test.
fn record(tool: &str, test: &str) {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_default();
    // libtest names each test's thread after the test.
    let test = std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .map_or_else(|| test.to_owned(), str::to_owned);
    let line = format!("{}\t{binary}::{}\n", one_line(tool), one_line(&test));
    let dir = record_dir();
    let _ = std::fs::create_dir_all(&dir);
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(run_name()))
    {
        // One write of one short line: appends from concurrent tests do
        // not interleave.
        let _ = file.write_all(line.as_bytes());
    }
}

fn one_line(s: &str) -> String {
    s.replace(['\t', '\n'], " ")
}

/// `<target>/<profile>/gpupool-skipped`, from the test binary's place in
/// `<target>/<profile>/deps/`; the temporary directory for a binary run
/// from anywhere else.
fn record_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            let deps = exe.parent()?;
            (deps.file_name()? == "deps").then(|| deps.parent().map(|p| p.join(RECORD_DIR)))?
        })
        .unwrap_or_else(|| std::env::temp_dir().join(RECORD_DIR))
}

/// The run: the parent process (`cargo test`, which starts every test
/// binary of the run) by pid and, where `/proc` has it, start time, so a
/// pid used again later starts a new record.
fn run_name() -> String {
    let pid = std::os::unix::process::parent_id();
    let started = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| start_time(&stat));
    match started {
        Some(t) => format!("{pid}-{t}"),
        None => pid.to_string(),
    }
}

/// Field 22 of `/proc/PID/stat` (the start time), counted after the
/// command name, which may hold spaces and parentheses.
fn start_time(stat: &str) -> Option<String> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19).map(str::to_owned)
}

/// Removes the records in `dir` last written more than `age` ago: those
/// of runs whose summary never ran.
fn prune(dir: &std::path::Path, age: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    for entry in entries.flatten() {
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > age);
        if old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// `skipped N tests for want of: A (n), B (m)` from a record's lines
/// (`tool<TAB>test`), tools by count, most first; a test recorded twice
/// counts once.
fn summary_line(record: &str) -> Option<String> {
    let mut tests = std::collections::BTreeSet::new();
    let mut by_tool: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
    for line in record.lines() {
        let Some((tool, test)) = line.split_once('\t') else {
            continue;
        };
        tests.insert(test);
        by_tool.entry(tool).or_default().insert(test);
    }
    if tests.is_empty() {
        return None;
    }
    let mut tools: Vec<(&str, usize)> = by_tool.iter().map(|(t, s)| (*t, s.len())).collect();
    tools.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let tools: Vec<String> = tools.iter().map(|(t, n)| format!("{t} ({n})")).collect();
    let n = tests.len();
    let noun = if n == 1 { "test" } else { "tests" };
    Some(format!(
        "skipped {n} {noun} for want of: {}",
        tools.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_fails_in_ci_and_is_a_skip_line_elsewhere() {
        assert_eq!(
            verdict(true, "the helm suite", "helm is not installed"),
            Err("CI is set, so the helm suite may not skip, yet helm is not installed".to_owned())
        );
        assert_eq!(
            verdict(false, "the helm suite", "helm is not installed"),
            Ok("skipping the helm suite: helm is not installed".to_owned())
        );
    }

    #[test]
    fn the_summary_counts_tests_by_tool_most_first() {
        let record = "helm\ta::one\n\
                      KUBEBUILDER_ASSETS\tb::one\n\
                      helm\ta::two\n\
                      helm\ta::two\n\
                      kubectl\tc::one\n\
                      helm\tc::three\n\
                      garbage line\n";
        assert_eq!(
            summary_line(record).as_deref(),
            Some("skipped 5 tests for want of: helm (3), KUBEBUILDER_ASSETS (1), kubectl (1)")
        );
        assert_eq!(
            summary_line("root\tx::y\n").as_deref(),
            Some("skipped 1 test for want of: root (1)")
        );
        assert_eq!(summary_line(""), None);
    }

    #[test]
    fn the_start_time_is_read_past_a_command_name_with_spaces() {
        let stat = "4242 (cargo (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 8 0 987654 12345 678";
        assert_eq!(start_time(stat).as_deref(), Some("987654"));
        assert_eq!(start_time("garbage"), None);
    }
}
