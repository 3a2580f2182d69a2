//! Where a daemon's Kubernetes client configuration is looked for outside a
//! pod, so that "no configuration" is said by its path rather than by the
//! client library's nested, debug-quoted error. One rule for the operator
//! and the device plugin.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// The kubeconfig kube's default configuration reads outside a pod that
/// does not exist: the first file in `KUBECONFIG`, else `~/.kube/config`.
/// `None` when that file exists or the process runs in a pod (`in_pod`), so
/// the client's own error says why the configuration it found is unusable.
pub fn missing(
    kubeconfig_env: Option<&OsStr>,
    in_pod: bool,
    home: Option<&Path>,
) -> Option<PathBuf> {
    if in_pod {
        return None;
    }
    let path = match kubeconfig_env.filter(|v| !v.is_empty()) {
        Some(list) => std::env::split_paths(list).next()?,
        None => home?.join(".kube").join("config"),
    };
    (!path.exists()).then_some(path)
}

/// [`missing`] for this process's environment (`KUBECONFIG`, `HOME`,
/// `KUBERNETES_SERVICE_HOST`).
pub fn missing_here() -> Option<PathBuf> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    missing(
        std::env::var_os("KUBECONFIG").as_deref(),
        std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
        home.as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_kubeconfig_is_named_by_its_path() {
        let dir = tempfile::tempdir().expect("dir");
        let present = dir.path().join("present");
        std::fs::write(&present, "").expect("write");
        let absent = dir.path().join("absent");
        let home = dir.path().join("home");
        assert_eq!(
            missing(Some(absent.as_os_str()), false, Some(&home)),
            Some(absent.clone())
        );
        assert_eq!(
            missing(None, false, Some(&home)),
            Some(home.join(".kube/config"))
        );
        assert_eq!(
            missing(Some(present.as_os_str()), false, None),
            None,
            "the client's own error explains an unusable file"
        );
        assert_eq!(
            missing(Some(absent.as_os_str()), true, None),
            None,
            "in a pod"
        );
    }
}
