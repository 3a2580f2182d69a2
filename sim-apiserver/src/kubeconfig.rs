//! Kubeconfig files for the simulated cluster (token authentication).

use std::io::Write;
use std::path::Path;

/// A kubeconfig with one cluster, user and context, all named `gpupool-sim`;
/// `ca_pem` is embedded as `certificate-authority-data` when serving TLS.
pub fn render(server: &str, ca_pem: Option<&str>, token: &str) -> String {
    let ca = ca_pem
        .map(|pem| {
            format!(
                "    certificate-authority-data: {}\n",
                crate::util::base64_encode(pem.as_bytes())
            )
        })
        .unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: gpupool-sim\n  cluster:\n    server: {server}\n{ca}users:\n- name: gpupool-sim\n  user:\n    token: {token}\ncontexts:\n- name: gpupool-sim\n  context:\n    cluster: gpupool-sim\n    user: gpupool-sim\n    namespace: default\ncurrent-context: gpupool-sim\npreferences: {{}}\n"
    )
}

/// Writes a kubeconfig readable only by its owner, all at once: the file
/// appears complete or not at all.
pub fn write(path: &Path, contents: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    // Written aside and renamed into place: whoever waits for the file
    // (a script's `until [ -s kubeconfig ]`) never reads half of it.
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".{}.tmp", std::process::id()));
    let aside = std::path::PathBuf::from(aside);
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let written = opts
        .open(&aside)
        .and_then(|mut f| f.write_all(contents.as_bytes()))
        .and_then(|()| std::fs::rename(&aside, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&aside);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_parses_with_kube() {
        let y = render("http://127.0.0.1:1234", Some("PEM"), "tok");
        let kc = kube::config::Kubeconfig::from_yaml(&y).expect("valid kubeconfig");
        assert_eq!(kc.current_context.as_deref(), Some("gpupool-sim"));
        let cluster = kc.clusters[0].cluster.as_ref().expect("cluster");
        assert_eq!(
            cluster.certificate_authority_data.as_deref(),
            Some(crate::util::base64_encode(b"PEM").as_str())
        );
        assert_eq!(
            kc.clusters[0]
                .cluster
                .as_ref()
                .and_then(|c| c.server.as_deref()),
            Some("http://127.0.0.1:1234")
        );
    }

    #[test]
    fn write_is_private_complete_and_leaves_nothing_aside() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/kubeconfig");
        write(&path, "first").expect("written");
        write(&path, "second").expect("rewritten");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "second");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["kubeconfig"], "no temporary file is left");
    }

    #[test]
    fn write_into_a_directory_path_fails_and_leaves_nothing_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("taken");
        std::fs::create_dir(&path).expect("a directory where the file goes");
        write(&path, "x").expect_err("cannot replace a directory");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["taken"]);
    }
}
