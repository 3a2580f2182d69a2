//! Finding and running the helm binary the chart tests use, shared by the
//! chart, install and real-cluster suites.

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Said when no helm is installed (a failure in CI, a skip elsewhere).
const MISSING: &str = "helm is not installed; run .ci/install-helm.sh";

/// The repository root (parent of the tests crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Runs `helm args` from the repository root against `kubeconfig`, with
/// helm's cache, config and data under `home`; stdout, or stderr on failure.
pub fn helm_run(
    helm: &Path,
    home: &Path,
    kubeconfig: &Path,
    args: &[&str],
) -> Result<String, String> {
    let out = std::process::Command::new(helm)
        .args(args)
        .current_dir(repo_root())
        .env("KUBECONFIG", kubeconfig)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The helm binary: `$HELM` (which must exist), else `.tools/bin/helm`;
/// `None` (after `tool_check::missing` has said so: a failure in CI, a
/// skip elsewhere) when neither is there.
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
        gpupool_sim_apiserver::tool_check::missing("the helm tests", "helm", MISSING);
        None
    }
}
