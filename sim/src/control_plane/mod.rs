//! A real Kubernetes control plane on loopback, envtest-style: etcd,
//! kube-apiserver and (optionally) kube-scheduler and
//! kube-controller-manager, started from the directory `KUBEBUILDER_ASSETS`
//! names, with a fresh CA, client certificates and service-account keys.
//!
//! Guarantees: [`ControlPlane::start`] returns once `/readyz` answers `ok`
//! (and, with the controller-manager, once the `default` ServiceAccount
//! exists, without which no pod can be created); every process runs under
//! `setpriv --pdeathsig KILL` like the simulator's other children, so even
//! a SIGKILL of the process that started them leaves none behind; the run
//! directory holds each process's log (`logs/<name>.log`), the PKI and the
//! admin kubeconfig.

pub mod certs;
pub mod rbac;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::cluster::processes::{ChildProcess, ProcessError, ProcessSpec};
use certs::{Ca, CertError, CertPair, Credentials};
use gpupool_sim_apiserver::ports;

/// The environment variable naming the assets directory (the envtest
/// convention of controller-runtime's `setup-envtest`).
pub const ASSETS_ENV: &str = "KUBEBUILDER_ASSETS";

/// The binaries an assets directory must hold.
pub const ETCD: &str = "etcd";
/// The API server binary.
pub const KUBE_APISERVER: &str = "kube-apiserver";
/// The scheduler binary.
pub const KUBE_SCHEDULER: &str = "kube-scheduler";
/// The controller-manager binary.
pub const KUBE_CONTROLLER_MANAGER: &str = "kube-controller-manager";

/// What the kernel sends each control-plane process when the process that
/// started it dies: SIGKILL, because kube-apiserver's graceful shutdown
/// waits on an etcd that died at the same moment, and nothing they hold
/// outlives the run.
const DEATH_SIGNAL: &str = "KILL";

/// The Service CIDR given to the API server and controller-manager.
const SERVICE_CIDR: &str = "10.96.0.0/12";

/// The `kubernetes` Service's cluster IP: the first address of
/// [`SERVICE_CIDR`], which in-cluster clients dial.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);

/// The port of the `kubernetes` Service.
pub const KUBERNETES_SERVICE_PORT: u16 = 443;

/// Feature gates the API server and real kubelets run with:
/// `ResourceHealthStatus` lets a pod's status carry the health of its
/// devices (`allocatedResourcesStatus`).
pub const FEATURE_GATES: &str = "ResourceHealthStatus=true";

/// Why the control plane could not start or be used.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    /// The assets directory lacks a binary.
    #[error(
        "{dir} has no {binary} (an envtest assets directory holds etcd, kube-apiserver, kube-scheduler and kube-controller-manager; set {ASSETS_ENV} or --kube-assets)"
    )]
    MissingBinary {
        /// The assets directory.
        dir: PathBuf,
        /// The binary not found there.
        binary: String,
    },
    /// Generating the PKI failed.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// A process could not be started or stopped.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// A file in the run directory could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A client for the API server could not be built.
    #[error("cannot build a client for the control plane: {0}")]
    Client(String),
    /// A component did not become ready; the message names it and its log.
    #[error("{0}")]
    NotReady(String),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ControlPlaneError + '_ {
    move |source| ControlPlaneError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How to start a control plane.
#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    /// The envtest assets directory.
    pub assets: PathBuf,
    /// Where PKI, data, kubeconfigs and logs go (created if missing).
    pub dir: PathBuf,
    /// Run kube-scheduler.
    pub scheduler: bool,
    /// Run kube-controller-manager (garbage collector, namespaces,
    /// ServiceAccounts, Deployments …; never the node-lifecycle controller,
    /// which would taint nodes whose heartbeats it does not trust).
    pub controller_manager: bool,
    /// How long start waits for each component.
    pub ready_timeout: Duration,
    /// Set up for real kubelets and their pods: the API server serves on
    /// this host address (pods reach it through their bridge's gateway)
    /// instead of 127.0.0.1, with what real nodes need (privileged pods, a
    /// kubelet client certificate, webhooks reached at their Service's
    /// endpoints since no kube-proxy runs, the `not-ready` taint lifted by
    /// the node-lifecycle controller), and the controller-manager runs
    /// every controller.
    pub real_nodes_host: Option<Ipv4Addr>,
}

impl ControlPlaneConfig {
    /// Every component, from `assets`, in `dir`.
    pub fn new(assets: impl Into<PathBuf>, dir: impl Into<PathBuf>) -> Self {
        ControlPlaneConfig {
            assets: assets.into(),
            dir: dir.into(),
            scheduler: true,
            controller_manager: true,
            ready_timeout: Duration::from_secs(90),
            real_nodes_host: None,
        }
    }
}

/// The assets directory from [`ASSETS_ENV`], when set and not empty.
pub fn assets_from_env() -> Option<PathBuf> {
    std::env::var_os(ASSETS_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// A running control plane. Stop it with [`ControlPlane::stop`]; dropping
/// it kills every process.
pub struct ControlPlane {
    dir: PathBuf,
    url: String,
    api_port: u16,
    ca: Ca,
    admin_kubeconfig: PathBuf,
    /// Newest last: stopped in reverse order, etcd last.
    processes: Vec<ChildProcess>,
}

/// `N` distinct free TCP ports on 127.0.0.1 (see [`ports::free_ports`]).
fn free_ports<const N: usize>() -> Result<[u16; N], ControlPlaneError> {
    ports::free_ports().map_err(io_error(Path::new("127.0.0.1:0")))
}

fn write_file(path: &Path, text: &str) -> Result<(), ControlPlaneError> {
    std::fs::write(path, text).map_err(io_error(path))
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver, then the scheduler and
    /// controller-manager when configured, and waits until they serve.
    pub async fn start(config: ControlPlaneConfig) -> Result<Self, ControlPlaneError> {
        let mut wanted = vec![ETCD, KUBE_APISERVER];
        if config.scheduler {
            wanted.push(KUBE_SCHEDULER);
        }
        if config.controller_manager {
            wanted.push(KUBE_CONTROLLER_MANAGER);
        }
        for b in &wanted {
            if !config.assets.join(b).is_file() {
                return Err(ControlPlaneError::MissingBinary {
                    dir: config.assets.clone(),
                    binary: (*b).to_owned(),
                });
            }
        }
        let dir = config.dir.clone();
        let pki = dir.join("pki");
        let logs = dir.join("logs");
        for d in [&pki, &logs, &dir.join("etcd")] {
            std::fs::create_dir_all(d).map_err(io_error(d))?;
        }

        let ca = Ca::generate()?;
        let extra_names: Vec<String> = config
            .real_nodes_host
            .map(|ip| vec![ip.to_string(), KUBERNETES_SERVICE_IP.to_string()])
            .unwrap_or_default();
        let serving = ca.serving(&extra_names)?;
        let (sa_key, sa_pub) = certs::service_account_key()?;
        let files = [
            ("ca.crt", ca.pair.cert_pem.as_str()),
            ("ca.key", ca.pair.key_pem.as_str()),
            ("apiserver.crt", serving.cert_pem.as_str()),
            ("apiserver.key", serving.key_pem.as_str()),
            ("sa.key", sa_key.as_str()),
            ("sa.pub", sa_pub.as_str()),
        ];
        for (name, text) in files {
            write_file(&pki.join(name), text)?;
        }
        let p = |name: &str| pki.join(name).into_os_string();

        let [etcd_port, peer_port, api_port] = free_ports()?;
        let api_ip = config.real_nodes_host.unwrap_or(Ipv4Addr::LOCALHOST);
        let url = format!("https://{api_ip}:{api_port}");
        let mut plane = ControlPlane {
            api_port,
            admin_kubeconfig: dir.join("admin.kubeconfig"),
            dir: dir.clone(),
            url,
            ca,
            processes: Vec::new(),
        };
        plane.write_cert_kubeconfig(
            &plane.admin_kubeconfig.clone(),
            "gpupool-sim-admin",
            &["system:masters"],
        )?;

        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd = ProcessSpec {
            name: "etcd".into(),
            program: config.assets.join(ETCD),
            args: [
                "--name",
                "gpupool-sim",
                "--data-dir",
                &dir.join("etcd").to_string_lossy(),
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &format!("gpupool-sim={peer_url}"),
                // Tests want speed over durability.
                "--unsafe-no-fsync",
            ]
            .iter()
            .map(Into::into)
            .collect(),
            env: vec![(
                "ETCD_UNSUPPORTED_ARCH".into(),
                std::env::consts::ARCH.into(),
            )],
        };
        plane.processes.push(ChildProcess::spawn_with_death_signal(
            &etcd,
            &logs,
            DEATH_SIGNAL,
        )?);
        plane
            .wait_until("etcd", config.ready_timeout, || async {
                crate::cluster::sim::http_status(etcd_port, "/health").await == Some(200)
            })
            .await?;

        let mut apiserver = ProcessSpec {
            name: "kube-apiserver".into(),
            program: config.assets.join(KUBE_APISERVER),
            args: vec![
                format!("--bind-address={api_ip}").into(),
                format!("--advertise-address={api_ip}").into(),
                format!("--secure-port={api_port}").into(),
                format!("--etcd-servers={etcd_url}").into(),
                "--client-ca-file".into(),
                p("ca.crt"),
                "--tls-cert-file".into(),
                p("apiserver.crt"),
                "--tls-private-key-file".into(),
                p("apiserver.key"),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                "--service-account-key-file".into(),
                p("sa.pub"),
                "--service-account-signing-key-file".into(),
                p("sa.key"),
                format!("--service-cluster-ip-range={SERVICE_CIDR}").into(),
                "--authorization-mode=Node,RBAC".into(),
                "--enable-admission-plugins=NodeRestriction".into(),
                // Endpoints refuse loopback addresses.
                "--endpoint-reconciler-type=none".into(),
                format!("--feature-gates={FEATURE_GATES}").into(),
            ],
            env: Vec::new(),
        };
        if config.real_nodes_host.is_some() {
            plane.write_cert_files(
                &pki,
                "kubelet-client",
                "kube-apiserver-kubelet-client",
                &["system:masters"],
            )?;
            apiserver.args.extend([
                // The device plugin's DaemonSet mounts host paths.
                "--allow-privileged=true".into(),
                "--kubelet-client-certificate".into(),
                p("kubelet-client.crt"),
                "--kubelet-client-key".into(),
                p("kubelet-client.key"),
                "--kubelet-certificate-authority".into(),
                p("ca.crt"),
                "--kubelet-preferred-address-types=InternalIP".into(),
                // No kube-proxy: webhooks are called at their Service's
                // endpoints, not its cluster IP.
                "--enable-aggregator-routing=true".into(),
            ]);
        } else {
            // On by default, it taints every new Node not-ready; with no
            // node-lifecycle controller nothing would lift the taint.
            apiserver
                .args
                .push("--disable-admission-plugins=TaintNodesByCondition".into());
        }
        // Enough to see requests refused and webhooks called, not every flag.
        apiserver.args.push("--v=1".into());
        plane.processes.push(ChildProcess::spawn_with_death_signal(
            &apiserver,
            &logs,
            DEATH_SIGNAL,
        )?);
        let client = plane.client().await?;
        plane
            .wait_until("kube-apiserver", config.ready_timeout, || {
                let client = client.clone();
                async move {
                    let req = http::Request::get("/readyz").body(Vec::new());
                    match req {
                        Ok(req) => client.request_text(req).await.is_ok_and(|t| t == "ok"),
                        Err(_) => false,
                    }
                }
            })
            .await?;

        if config.controller_manager {
            let kc = dir.join("controller-manager.kubeconfig");
            plane.write_cert_kubeconfig(&kc, "system:kube-controller-manager", &[])?;
            let [port] = free_ports()?;
            // Real kubelets post heartbeats, and their pods' service-account
            // volumes need the `openshift-service-ca.crt` ConfigMap this
            // build's publisher writes; simulated nodes have neither need.
            let controllers = if config.real_nodes_host.is_some() {
                "--controllers=*"
            } else {
                "--controllers=*,-node-lifecycle-controller,-service-ca-certificate-publisher-controller"
            };
            let spec = ProcessSpec {
                name: "kube-controller-manager".into(),
                program: config.assets.join(KUBE_CONTROLLER_MANAGER),
                args: vec![
                    "--kubeconfig".into(),
                    kc.clone().into(),
                    "--authentication-kubeconfig".into(),
                    kc.clone().into(),
                    "--authorization-kubeconfig".into(),
                    kc.into(),
                    "--bind-address=127.0.0.1".into(),
                    format!("--secure-port={port}").into(),
                    "--leader-elect=false".into(),
                    controllers.into(),
                    "--use-service-account-credentials=true".into(),
                    "--service-account-private-key-file".into(),
                    p("sa.key"),
                    "--root-ca-file".into(),
                    p("ca.crt"),
                    "--cluster-signing-cert-file".into(),
                    p("ca.crt"),
                    "--cluster-signing-key-file".into(),
                    p("ca.key"),
                    "--allocate-node-cidrs=false".into(),
                    format!("--service-cluster-ip-range={SERVICE_CIDR}").into(),
                ],
                env: Vec::new(),
            };
            plane.processes.push(ChildProcess::spawn_with_death_signal(
                &spec,
                &logs,
                DEATH_SIGNAL,
            )?);
        }
        if config.scheduler {
            let kc = dir.join("scheduler.kubeconfig");
            plane.write_cert_kubeconfig(&kc, "system:kube-scheduler", &[])?;
            let [port] = free_ports()?;
            let spec = ProcessSpec {
                name: "kube-scheduler".into(),
                program: config.assets.join(KUBE_SCHEDULER),
                args: vec![
                    "--kubeconfig".into(),
                    kc.clone().into(),
                    "--authentication-kubeconfig".into(),
                    kc.clone().into(),
                    "--authorization-kubeconfig".into(),
                    kc.into(),
                    "--bind-address=127.0.0.1".into(),
                    format!("--secure-port={port}").into(),
                    "--leader-elect=false".into(),
                ],
                env: Vec::new(),
            };
            plane.processes.push(ChildProcess::spawn_with_death_signal(
                &spec,
                &logs,
                DEATH_SIGNAL,
            )?);
        }
        if config.controller_manager {
            // Pods are refused until their namespace's default
            // ServiceAccount exists; the controller-manager creates it.
            let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
            plane
                .wait_until(
                    "kube-controller-manager (the default ServiceAccount)",
                    config.ready_timeout,
                    || {
                        let accounts = accounts.clone();
                        async move { accounts.get_opt("default").await.ok().flatten().is_some() }
                    },
                )
                .await?;
        }
        tracing::info!(url = %plane.url, dir = %plane.dir.display(), "control plane ready");
        Ok(plane)
    }

    /// Polls `ready` until it holds; fails naming `what` with the log tail
    /// of the newest process when a process exits or `timeout` passes.
    async fn wait_until<F, Fut>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: F,
    ) -> Result<(), ControlPlaneError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            if ready().await {
                return Ok(());
            }
            for p in &mut self.processes {
                if let Some(status) = p.exit_status() {
                    return Err(ControlPlaneError::NotReady(format!(
                        "{} exited ({status}) while waiting for {what}; its log {} ends with:\n{}",
                        p.name(),
                        p.log().display(),
                        crate::cluster::sim::log_tail(p.log(), 20)
                    )));
                }
            }
            if Instant::now() >= deadline {
                let tail = self
                    .processes
                    .last()
                    .map(|p| {
                        format!(
                            "; the log {} ends with:\n{}",
                            p.log().display(),
                            crate::cluster::sim::log_tail(p.log(), 20)
                        )
                    })
                    .unwrap_or_default();
                return Err(ControlPlaneError::NotReady(format!(
                    "{what} was not ready within {timeout:?}{tail}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The API server's URL (`https://127.0.0.1:<port>`, or the host
    /// address with real nodes).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The API server's port.
    pub fn api_port(&self) -> u16 {
        self.api_port
    }

    /// The CA that signs every certificate of this control plane.
    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// Writes `<name>.crt` and `<name>.key` in `dir`: a client certificate
    /// for `user` in `groups`, the key readable by its owner only.
    pub fn write_cert_files(
        &self,
        dir: &Path,
        name: &str,
        user: &str,
        groups: &[&str],
    ) -> Result<(), ControlPlaneError> {
        let pair = self.ca.client(user, groups)?;
        write_file(&dir.join(format!("{name}.crt")), &pair.cert_pem)?;
        write_private(&dir.join(format!("{name}.key")), &pair.key_pem)
    }

    /// The CA certificate (PEM) that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca.pair.cert_pem
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin kubeconfig (a client certificate in `system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// A client authenticated as the admin.
    pub async fn client(&self) -> Result<Client, ControlPlaneError> {
        client_from_kubeconfig(&self.admin_kubeconfig).await
    }

    /// Writes a kubeconfig that authenticates as `user` in `groups` with a
    /// client certificate signed by the control plane's CA.
    pub fn write_cert_kubeconfig(
        &self,
        path: &Path,
        user: &str,
        groups: &[&str],
    ) -> Result<CertPair, ControlPlaneError> {
        let pair = self.ca.client(user, groups)?;
        let text = certs::kubeconfig(&self.url, self.ca_pem(), Credentials::Cert(&pair));
        write_private(path, &text)?;
        Ok(pair)
    }

    /// Writes a kubeconfig that authenticates with a bearer `token`.
    pub fn write_token_kubeconfig(
        &self,
        path: &Path,
        token: &str,
    ) -> Result<(), ControlPlaneError> {
        let text = certs::kubeconfig(&self.url, self.ca_pem(), Credentials::Token(token));
        write_private(path, &text)
    }

    /// PIDs of the control plane's processes still running.
    pub fn pids(&mut self) -> Vec<u32> {
        self.processes
            .iter_mut()
            .filter_map(|p| {
                if p.exit_status().is_none() {
                    p.pid()
                } else {
                    None
                }
            })
            .collect()
    }

    /// Stops the controller-manager and the scheduler, so no controller
    /// makes or places a pod any more (teardown deletes the pods of real
    /// nodes after this, and none must come back).
    pub async fn stop_controllers(&mut self) -> Result<(), ControlPlaneError> {
        for p in &mut self.processes {
            if p.name() == KUBE_CONTROLLER_MANAGER || p.name() == KUBE_SCHEDULER {
                p.stop(Duration::from_secs(5)).await?;
            }
        }
        Ok(())
    }

    /// Stops every process, newest first (SIGTERM, then SIGKILL after 5 s).
    pub async fn stop(mut self) -> Result<(), ControlPlaneError> {
        let mut first = None;
        while let Some(mut p) = self.processes.pop() {
            if let Err(e) = p.stop(Duration::from_secs(5)).await {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// Writes a file only its owner may read (it holds a private key or token).
pub(crate) fn write_private(path: &Path, text: &str) -> Result<(), ControlPlaneError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_error(parent))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(io_error(path))
}

/// A kube client from a kubeconfig file.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client, ControlPlaneError> {
    // Read here, so that an error names the path plainly (kube's own
    // error quotes it with Debug).
    let text = std::fs::read_to_string(path).map_err(|e| {
        ControlPlaneError::Client(format!("cannot read kubeconfig {}: {e}", path.display()))
    })?;
    let kc = Kubeconfig::from_yaml(&text)
        .map_err(|e| ControlPlaneError::Client(format!("kubeconfig {}: {e}", path.display())))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| ControlPlaneError::Client(e.to_string()))?;
    Client::try_from(config).map_err(|e| ControlPlaneError::Client(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_kubeconfig_is_named_plainly() {
        let Err(err) = client_from_kubeconfig(Path::new("/nonexistent")).await else {
            panic!("a client from a file that does not exist");
        };
        let text = err.to_string();
        assert!(text.contains("kubeconfig /nonexistent: "), "{text}");
        assert!(!text.contains('"'), "{text}");
    }

    #[tokio::test]
    async fn a_directory_without_the_binaries_is_named_with_the_variable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err =
            match ControlPlane::start(ControlPlaneConfig::new(dir.path(), dir.path().join("run")))
                .await
            {
                Err(e) => e,
                Ok(_) => panic!("started without binaries"),
            };
        let msg = err.to_string();
        assert!(
            msg.contains("etcd") && msg.contains(ASSETS_ENV) && msg.contains("--kube-assets"),
            "{msg}"
        );
    }
}
