//! The only part that talks to the API server: the kubeconfig, and the
//! reads (never a write) the views need, with each failure turned into an
//! [`Error`] that names what is missing.

use std::path::{Path, PathBuf};

use gpupool_api::{GpuLease, GpuLeaseClass};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::error::Error;

/// A connection to the cluster the kubeconfig names.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    /// The context's namespace (`default` when it names none).
    pub default_namespace: String,
    server: String,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("server", &self.server)
            .field("default_namespace", &self.default_namespace)
            .finish_non_exhaustive()
    }
}

/// Leases as far as the credentials allow.
pub struct Leases {
    /// The leases read.
    pub items: Vec<GpuLease>,
    /// True when they are every namespace's.
    pub all_visible: bool,
    /// The namespace they were limited to when not every namespace could be listed.
    pub namespace: Option<String>,
}

/// Pods as far as the credentials allow.
#[derive(Debug, Clone, Default)]
pub struct Pods {
    /// The pods read.
    pub items: Vec<Pod>,
    /// True when they are every namespace's.
    pub all_visible: bool,
    /// The namespace they were limited to when not every namespace's could
    /// be listed; `None` with `all_visible` false: not even that one's.
    pub namespace: Option<String>,
}

/// Connects with `--kubeconfig` (else `KUBECONFIG`, else `~/.kube/config`,
/// else the in-cluster service account) and `--context`. Errors name the
/// file or context that is missing.
pub async fn connect(kubeconfig: Option<&Path>, context: Option<&str>) -> Result<Cluster, Error> {
    let options = KubeConfigOptions {
        context: context.map(str::to_owned),
        ..Default::default()
    };
    let paths = kubeconfig_paths(kubeconfig)?;
    let config = match paths {
        Some(paths) => {
            let kc = read_kubeconfigs(&paths)?;
            let shown = paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(":");
            match context {
                Some(c) if !kc.contexts.iter().any(|n| n.name == c) => {
                    return Err(Error::Kubeconfig(format!(
                        "context \"{c}\" not found in kubeconfig {shown} (kubectl config get-contexts)"
                    )));
                }
                None if kc.current_context.as_deref().is_none_or(str::is_empty) => {
                    return Err(Error::Kubeconfig(format!(
                        "kubeconfig {shown} has no current-context: pass --context (kubectl config get-contexts)"
                    )));
                }
                _ => {}
            }
            Config::from_custom_kubeconfig(kc, &options)
                .await
                .map_err(|e| Error::Kubeconfig(format!("kubeconfig {shown}: {}", chain(&e))))?
        }
        None => Config::incluster().map_err(|_| {
            Error::Kubeconfig(
                "no kubeconfig: ~/.kube/config does not exist, KUBECONFIG is not set and this is not a pod (pass --kubeconfig PATH)"
                    .to_owned(),
            )
        })?,
    };
    let server = config.cluster_url.to_string();
    let default_namespace = config.default_namespace.clone();
    let client = Client::try_from(config).map_err(|e| Error::Api {
        what: format!("connect to {server}"),
        detail: chain(&e),
    })?;
    Ok(Cluster {
        client,
        default_namespace,
        server,
    })
}

/// The kubeconfig files to read, or `None` for in-cluster configuration.
fn kubeconfig_paths(explicit: Option<&Path>) -> Result<Option<Vec<PathBuf>>, Error> {
    if let Some(path) = explicit {
        return Ok(Some(vec![path.to_path_buf()]));
    }
    if let Some(value) = std::env::var_os("KUBECONFIG") {
        let paths: Vec<PathBuf> = std::env::split_paths(&value)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        if !paths.is_empty() {
            // kubectl skips the files of KUBECONFIG that do not exist.
            let existing: Vec<PathBuf> = paths.iter().filter(|p| p.exists()).cloned().collect();
            if existing.is_empty() {
                let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
                return Err(Error::Kubeconfig(format!(
                    "no kubeconfig: KUBECONFIG names {}, which does not exist",
                    shown.join(":")
                )));
            }
            return Ok(Some(existing));
        }
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    match home.map(|h| h.join(".kube").join("config")) {
        Some(p) if p.exists() => Ok(Some(vec![p])),
        _ if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => Ok(None),
        _ => Err(Error::Kubeconfig(
            "no kubeconfig: ~/.kube/config does not exist and KUBECONFIG is not set (pass --kubeconfig PATH)"
                .to_owned(),
        )),
    }
}

fn read_kubeconfigs(paths: &[PathBuf]) -> Result<Kubeconfig, Error> {
    let mut merged: Option<Kubeconfig> = None;
    for path in paths {
        // Read it here first: the file's own error is clearer than the loader's.
        if let Err(e) = std::fs::metadata(path) {
            return Err(Error::Kubeconfig(format!(
                "cannot read kubeconfig {}: {}",
                path.display(),
                io_reason(&e)
            )));
        }
        let kc = Kubeconfig::read_from(path).map_err(|e| {
            Error::Kubeconfig(format!("kubeconfig {}: {}", path.display(), chain(&e)))
        })?;
        merged = Some(match merged {
            None => kc,
            Some(m) => m.merge(kc).map_err(|e| {
                Error::Kubeconfig(format!("kubeconfig {}: {}", path.display(), chain(&e)))
            })?,
        });
    }
    Ok(merged.unwrap_or_default())
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_owned(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
        _ => e.to_string(),
    }
}

/// An error and its causes in words: each distinct message once, outermost
/// first, so that kube's wrappers do not hide the cause.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = err.source();
    }
    parts.join(": ")
}

impl Cluster {
    /// The API server's address, for messages.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// A client for watches.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Turns a failed request into an [`Error`].
    pub fn api_error(&self, what: &str, e: kube::Error) -> Error {
        match e {
            kube::Error::Api(status) if status.is_forbidden() => Error::Forbidden {
                what: what.to_owned(),
                message: status.message.clone(),
            },
            kube::Error::Api(status) => Error::Api {
                what: what.to_owned(),
                detail: if status.message.is_empty() {
                    format!("the API server answered {}", status.code)
                } else {
                    status.message.clone()
                },
            },
            kube::Error::SerdeError(e) => Error::Api {
                what: what.to_owned(),
                detail: format!("the API server sent an object this plugin cannot read: {e}"),
            },
            other => Error::Api {
                what: what.to_owned(),
                detail: format!(
                    "the API server at {} did not answer: {}",
                    self.server,
                    root(&other)
                ),
            },
        }
    }

    /// Leases of every namespace, or of `namespace` alone when the
    /// credentials may not list every namespace's (a tenant with the
    /// namespaced `view` or `edit` role). Errors: with `all_required` (`-A`),
    /// a refusal is [`Error::AllNamespacesForbidden`], naming the namespace
    /// shown without it; [`Error::LeaseCrdMissing`] when the CRD is absent;
    /// any other failure as [`Cluster::api_error`] words it.
    pub async fn leases(&self, namespace: &str, all_required: bool) -> Result<Leases, Error> {
        let all: Api<GpuLease> = Api::all(self.client.clone());
        match all.list(&ListParams::default()).await {
            Ok(list) => Ok(Leases {
                items: list.items,
                all_visible: true,
                namespace: None,
            }),
            Err(kube::Error::Api(s)) if s.is_not_found() => Err(Error::LeaseCrdMissing),
            Err(kube::Error::Api(s)) if s.is_forbidden() && all_required => {
                Err(Error::AllNamespacesForbidden {
                    namespace: namespace.to_owned(),
                    message: s.message.clone(),
                })
            }
            Err(kube::Error::Api(s)) if s.is_forbidden() => {
                let ns: Api<GpuLease> = Api::namespaced(self.client.clone(), namespace);
                let list = ns.list(&ListParams::default()).await.map_err(|e| {
                    self.lease_error(&format!("list gpuleases in namespace {namespace}"), e)
                })?;
                Ok(Leases {
                    items: list.items,
                    all_visible: false,
                    namespace: Some(namespace.to_owned()),
                })
            }
            Err(e) => Err(self.lease_error("list gpuleases in all namespaces", e)),
        }
    }

    fn lease_error(&self, what: &str, e: kube::Error) -> Error {
        match e {
            kube::Error::Api(s) if s.is_not_found() => Error::LeaseCrdMissing,
            e => self.api_error(what, e),
        }
    }

    /// Every class; `Ok(None)` when the credentials may not list them (a
    /// RoleBinding grants nothing cluster-scoped) and `optional` says the
    /// caller can do without. Errors: [`Error::ClassCrdMissing`] when the
    /// CRD is absent; a refusal when not `optional`, and any other failure,
    /// as [`Cluster::api_error`] words it.
    pub async fn classes(&self, optional: bool) -> Result<Option<Vec<GpuLeaseClass>>, Error> {
        let api: Api<GpuLeaseClass> = Api::all(self.client.clone());
        match api.list(&ListParams::default()).await {
            Ok(list) => Ok(Some(list.items)),
            Err(kube::Error::Api(s)) if s.is_not_found() => Err(Error::ClassCrdMissing),
            Err(kube::Error::Api(s)) if s.is_forbidden() && optional => Ok(None),
            Err(e) => Err(self.api_error("list gpuleaseclasses", e)),
        }
    }

    /// Every node; `Ok(None)` when the credentials may not list nodes and
    /// `optional` says the caller can do without.
    pub async fn nodes(&self, optional: bool) -> Result<Option<Vec<Node>>, Error> {
        let api: Api<Node> = Api::all(self.client.clone());
        match api.list(&ListParams::default()).await {
            Ok(list) => Ok(Some(list.items)),
            Err(kube::Error::Api(s)) if s.is_forbidden() && optional => Ok(None),
            Err(e) => Err(self.api_error("list nodes", e)),
        }
    }

    /// Pods of every namespace, or of `namespace` alone when the
    /// credentials may not list every namespace's, or none when they may
    /// not list even those ([`Pods`] says which). Errors: any failure other
    /// than a refusal, as [`Cluster::api_error`] words it.
    pub async fn pods(&self, namespace: &str) -> Result<Pods, Error> {
        let all: Api<Pod> = Api::all(self.client.clone());
        match all.list(&ListParams::default()).await {
            Ok(list) => {
                return Ok(Pods {
                    items: list.items,
                    all_visible: true,
                    namespace: None,
                });
            }
            Err(kube::Error::Api(s)) if s.is_forbidden() => {}
            Err(e) => return Err(self.api_error("list pods in all namespaces", e)),
        }
        let ns: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match ns.list(&ListParams::default()).await {
            Ok(list) => Ok(Pods {
                items: list.items,
                all_visible: false,
                namespace: Some(namespace.to_owned()),
            }),
            Err(kube::Error::Api(s)) if s.is_forbidden() => Ok(Pods::default()),
            Err(e) => Err(self.api_error(&format!("list pods in namespace {namespace}"), e)),
        }
    }

    /// Pod `name` in `namespace`.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, Error> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(p)) => Ok(p),
            Ok(None) => Err(Error::PodNotFound {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            }),
            Err(e) => Err(self.api_error(&format!("get pod {namespace}/{name}"), e)),
        }
    }
}

/// The innermost cause: for a refused connection, the OS's words.
fn root(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("inner")]
    struct Inner;

    #[derive(Debug, thiserror::Error)]
    #[error("wrapper")]
    struct Wrapper(#[source] Inner);

    #[test]
    fn chains_say_each_cause_once() {
        assert_eq!(chain(&Outer(Inner)), "outer: inner");
        assert_eq!(chain(&Wrapper(Inner)), "wrapper: inner");
        assert_eq!(root(&Wrapper(Inner)), "inner");
    }

    #[tokio::test]
    async fn missing_kubeconfig_and_context_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nope");
        let err = connect(Some(&missing), None).await.expect_err("fails");
        assert_eq!(
            err.to_string(),
            format!("cannot read kubeconfig {}: no such file", missing.display())
        );
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1'}\nusers:\n- name: u\n  user: {token: t}\ncontexts:\n- name: ctx\n  context: {cluster: c, user: u, namespace: ml}\ncurrent-context: ctx\n",
        )
        .expect("write");
        let err = connect(Some(&path), Some("other"))
            .await
            .expect_err("fails");
        assert!(
            err.to_string()
                .starts_with("context \"other\" not found in kubeconfig"),
            "{err}"
        );
        let cluster = connect(Some(&path), Some("ctx"))
            .await
            .expect("connects lazily");
        assert_eq!(cluster.default_namespace, "ml");
        // Nothing listens on port 1: the error names the server and the cause, not Rust types.
        let err = cluster.classes(true).await.expect_err("unreachable");
        let text = err.to_string();
        assert!(
            text.starts_with(
                "cannot list gpuleaseclasses: the API server at https://127.0.0.1:1/ did not answer"
            ),
            "{text}"
        );
        assert!(!text.contains("Error("), "{text}");
        std::fs::write(&path, "apiVersion: v1\nkind: Config\n").expect("write");
        let err = connect(Some(&path), None).await.expect_err("fails");
        assert!(err.to_string().contains("has no current-context"), "{err}");
    }

    #[test]
    fn api_statuses_become_named_errors() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("kubeconfig");
            std::fs::write(
                &path,
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1'}\nusers:\n- name: u\n  user: {token: t}\ncontexts:\n- name: ctx\n  context: {cluster: c, user: u}\ncurrent-context: ctx\n",
            )
            .expect("write");
            let cluster = connect(Some(&path), None).await.expect("connects lazily");
            assert_eq!(cluster.default_namespace, "default");
            let status = |code: u16, reason: &str, message: &str| {
                kube::Error::Api(
                    kube::core::Status::failure(message, reason)
                        .with_code(code)
                        .boxed(),
                )
            };
            let cases = [
                (
                    cluster.lease_error("list gpuleases", status(404, "NotFound", "the server could not find the requested resource")),
                    "the GpuLease CRD is not installed (kubectl get crd gpuleases.gpupool.io)",
                ),
                (
                    cluster.api_error("list nodes", status(403, "Forbidden", "nodes is forbidden")),
                    "cannot list nodes: forbidden (nodes is forbidden)",
                ),
                (
                    cluster.api_error("list nodes", status(500, "InternalError", "")),
                    "cannot list nodes: the API server answered 500",
                ),
                (
                    cluster.api_error("get pod a/b", status(429, "TooManyRequests", "slow down")),
                    "cannot get pod a/b: slow down",
                ),
            ];
            for (err, want) in cases {
                assert_eq!(err.to_string(), want);
            }
        });
    }
}
