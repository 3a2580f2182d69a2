//! Finding the helm binary the chart tests run, shared by `helm_chart.rs`
//! and `helm_install.rs`.

use std::path::{Path, PathBuf};

/// Printed when no helm is installed and a test skips.
const SKIP_LINE: &str = "skipping: helm not installed; run .ci/install-helm.sh";

/// The repository root (parent of the tests crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The helm binary: `$HELM` (which must exist), else `.tools/bin/helm`;
/// `None` (after printing [`SKIP_LINE`]) when neither is there.
pub fn helm() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("HELM") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "HELM={} does not exist; run .ci/install-helm.sh",
            path.display()
        );
        return Some(path);
    }
    let installed = repo_root().join(".tools/bin/helm");
    if installed.is_file() {
        Some(installed)
    } else {
        eprintln!("{SKIP_LINE}");
        None
    }
}
