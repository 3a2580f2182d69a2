//! Prints the tests this `cargo test` run skipped for want of a tool, as
//! one line: `skipped 8 tests for want of: KUBEBUILDER_ASSETS (5), helm
//! (3)` (see `gpupool_sim_apiserver::tool_check`; in CI a missing tool
//! fails its test instead, so there is nothing to print).
//!
//! `cargo test --workspace` runs the test binaries package by package in
//! name order, and a package's suites in name order, so this suite runs
//! after those of `gpupool-e2e` and of this package, whose tests are the
//! ones that record their skips (the `kubectl-gpupool` suites run after
//! it). The line is written to stderr directly, which libtest does not
//! capture.

use std::io::Write;

#[test]
fn print_the_skipped_tests() {
    if let Some(line) = gpupool_sim_apiserver::tool_check::take_summary() {
        let _ = writeln!(std::io::stderr().lock(), "\n{line}\n");
    }
}

/// This suite must stay the last of its package, or it would print before
/// the suites that follow it have recorded their skips.
#[test]
fn this_suite_runs_last_in_its_package() {
    let me = std::path::Path::new(file!())
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("this file's name")
        .to_owned();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let later: Vec<String> = std::fs::read_dir(&dir)
        .expect("tests/")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let stem = name.strip_suffix(".rs")?.to_owned();
            (stem > me).then_some(stem)
        })
        .collect();
    assert!(
        later.is_empty(),
        "{later:?} would run after {me}; rename this suite to sort last"
    );
}
