//! [`SimCluster`]: the whole simulated cluster in one process — the
//! in-memory API server, the scheduler and one kubelet per node — plus the
//! real `gpupool-device-plugin` (one per node) and `gpupool-operator`
//! binaries as supervised child processes.
//!
//! With [`Backend::Real`] a real control plane (etcd, kube-apiserver,
//! kube-scheduler, kube-controller-manager) replaces the in-memory API
//! server and scheduler, and the simulator adds only what such a cluster
//! lacks here: the kubelets (with client certificates as
//! `system:node:<name>`, under the Node authorizer and NodeRestriction). The
//! operator and the device plugins then authenticate with tokens of their
//! ServiceAccounts bound by exactly the chart's RBAC, each device plugin's
//! token bound to its Node as a projected token is.
//!
//! With [`Backend::RealNodes`] the nodes are real too: a kubelet and
//! containerd each ([`crate::real_node`]), and pods run in containers of
//! the workload image. The operator and a device plugin per node still run
//! on this host, each plugin pointed at its node's kubelet directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpupool_api::names::DEFAULT_RESOURCE_NAME;
use gpupool_api::{GpuLease, GpuLeaseClass};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::coordination::v1::Lease as CoordinationLease;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Client, CustomResourceExt};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::kubelet::{KubeletConfig, KubeletError, RunningKubelet};
use super::processes::{ChildProcess, ProcessError, ProcessSpec, find_binary};
use super::proxy::ServiceProxy;
use super::scheduler::RunningScheduler;
use crate::control_plane::{
    self, ControlPlane, ControlPlaneConfig, ControlPlaneError, client_from_kubeconfig, rbac,
};
use crate::real_node::{RealCluster, RealClusterConfig};
use gpupool_sim_apiserver::ports;
use gpupool_sim_apiserver::{
    ADMIN_TOKEN, ApiServer, ApiServerConfig, ApiServerError, RunningApiServer, UserInfo,
};

/// Namespace the operator runs in.
pub const OPERATOR_NAMESPACE: &str = "gpupool-system";
/// User the operator authenticates as (its service account, the default gate owner).
pub const OPERATOR_USER: &str = "system:serviceaccount:gpupool-system:gpupool-operator";
/// User the device plugins authenticate as.
pub const DEVICE_PLUGIN_USER: &str = "system:serviceaccount:gpupool-system:gpupool-device-plugin";
/// The `userInfo.extra` key naming the node a bound service-account token
/// was issued for (Kubernetes 1.32+ puts it in every projected token of a
/// pod); each node's device plugin authenticates with it set to its node.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// Name of the device-plugin binary.
pub const DEVICE_PLUGIN_BIN: &str = "gpupool-device-plugin";
/// Name of the operator binary.
pub const OPERATOR_BIN: &str = "gpupool-operator";

const OPERATOR_TOKEN: &str = "gpupool-sim-operator-token";
/// Followed by the node's index: each node's device plugin has its own
/// token, as each pod's projected token is its own on a real cluster.
const DEVICE_PLUGIN_TOKEN_PREFIX: &str = "gpupool-sim-device-plugin-token-";
const SCHEDULER_TOKEN: &str = "gpupool-sim-scheduler-token";
const KUBELET_TOKEN_PREFIX: &str = "gpupool-sim-kubelet-token-";

/// Whether the cluster runs the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorMode {
    /// Never (plugin and scheduler side only).
    Off,
    /// When its binary is found and becomes ready; otherwise the cluster
    /// runs without it and [`SimCluster::operator_note`] says why.
    IfAvailable,
    /// Always; the cluster fails to start without it.
    Required,
}

/// Which API server the cluster runs on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Backend {
    /// The in-memory API server and the simulator's own scheduler.
    #[default]
    Simulated,
    /// A real control plane from an envtest assets directory
    /// (`KUBEBUILDER_ASSETS`): etcd, kube-apiserver, kube-scheduler and
    /// kube-controller-manager.
    Real {
        /// The assets directory.
        assets: PathBuf,
    },
    /// A real control plane as [`Backend::Real`], and real nodes: a real
    /// kubelet and containerd each ([`crate::real_node`]; needs root). Pods
    /// run as containers of [`crate::real_node::WORKLOAD_IMAGE`].
    RealNodes {
        /// The assets directory, with the kubelet.
        assets: PathBuf,
        /// The directory of image tarballs `.ci/build-images.sh` writes
        /// (the pause and workload images are loaded into every node).
        images: PathBuf,
    },
}

/// The environment variable naming the images directory of
/// [`Backend::RealNodes`] (`.ci/build-images.sh` prints it).
pub const IMAGES_ENV: &str = "GPUPOOL_IMAGES_DIR";

/// The environment variable that picks the backend of suites that honour
/// it ([`Backend::from_env`]): `real`, `real-node` or `simulated` (the
/// default).
pub const BACKEND_ENV: &str = "GPUPOOL_E2E_BACKEND";

impl Backend {
    /// [`Backend::Real`] when [`BACKEND_ENV`] is `real` and
    /// `KUBEBUILDER_ASSETS` names a directory; [`Backend::RealNodes`] when
    /// it is `real-node` (with `KUBEBUILDER_ASSETS` and [`IMAGES_ENV`],
    /// empty when unset, so that starting fails and names what is missing:
    /// whoever asks for real nodes gets them or an error, never a
    /// simulation); else [`Backend::Simulated`]: the one switch a suite
    /// needs to run on every backend.
    pub fn from_env() -> Self {
        match (
            std::env::var(BACKEND_ENV).as_deref(),
            control_plane::assets_from_env(),
        ) {
            (Ok("real"), Some(assets)) => Backend::Real { assets },
            (Ok("real-node"), assets) => Backend::RealNodes {
                assets: assets.unwrap_or_default(),
                images: std::env::var_os(IMAGES_ENV)
                    .map(PathBuf::from)
                    .unwrap_or_default(),
            },
            _ => Backend::Simulated,
        }
    }

    /// Whether this is a real control plane (with simulated or real nodes).
    pub fn is_real(&self) -> bool {
        matches!(self, Backend::Real { .. } | Backend::RealNodes { .. })
    }

    /// Whether the nodes are real kubelets and containerd.
    pub fn is_real_nodes(&self) -> bool {
        matches!(self, Backend::RealNodes { .. })
    }
}

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The API server: in-memory (default) or a real control plane.
    pub backend: Backend,
    /// Number of nodes (`node-1` … `node-N`).
    pub nodes: u32,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Slots per GPU (`--sessions-per-gpu` of the plugins).
    pub sessions_per_gpu: u32,
    /// API server port; 0 picks a free one.
    pub port: u16,
    /// Run directory (kubelet dirs, logs, kubeconfigs); `None` creates a
    /// fresh one under the system temp dir.
    pub run_dir: Option<PathBuf>,
    /// Remove the run directory when the cluster stops (only one it created).
    pub remove_run_dir: bool,
    /// Where to write the admin kubeconfig; default `<run dir>/kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// The device-plugin binary; default: found next to the running executable.
    pub device_plugin_bin: Option<PathBuf>,
    /// The operator binary; default: found next to the running executable.
    pub operator_bin: Option<PathBuf>,
    /// Whether to run the operator.
    pub operator: OperatorMode,
    /// Flags given to the operator after the ones the cluster sets
    /// (`--webhook-port`, `--metrics-port`, `--webhook-bind-address`,
    /// `--metrics-bind-address` (both 127.0.0.1), `--webhook-url`,
    /// `--leader-elect`, `--identity`, `--namespace`). Default:
    /// `--resync-seconds 2`.
    pub operator_args: Vec<String>,
    /// Operator replicas. One runs with `--leader-elect=false`; more elect
    /// a leader on the coordination Lease and all serve the webhook behind
    /// one address, as behind a Service.
    pub operator_replicas: usize,
    /// Longest simulated termination of a deleted pod.
    pub max_termination: Duration,
    /// How long start waits for the plugins and the operator to be ready.
    pub ready_timeout: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            backend: Backend::Simulated,
            nodes: 2,
            gpus_per_node: 2,
            sessions_per_gpu: 1,
            port: 0,
            run_dir: None,
            remove_run_dir: true,
            kubeconfig: None,
            device_plugin_bin: None,
            operator_bin: None,
            operator: OperatorMode::IfAvailable,
            operator_args: vec!["--resync-seconds".into(), "2".into()],
            operator_replicas: 1,
            max_termination: Duration::from_secs(1),
            ready_timeout: Duration::from_secs(30),
        }
    }
}

/// Why the cluster could not start or a control failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Bad configuration; the message names the setting.
    #[error("{0}")]
    Config(String),
    /// The API server failed.
    #[error(transparent)]
    ApiServer(#[from] ApiServerError),
    /// The real control plane failed.
    #[error(transparent)]
    ControlPlane(#[from] ControlPlaneError),
    /// An API request of the simulator failed.
    #[error("{what}: {source}")]
    Api {
        /// What was being done.
        what: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// A kubelet failed.
    #[error(transparent)]
    Kubelet(#[from] KubeletError),
    /// A child process failed.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// A real node failed.
    #[error(transparent)]
    RealNode(#[from] crate::real_node::RealNodeError),
    /// A file in the run directory could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// Something did not become ready in time; the message says what and
    /// where its log is.
    #[error("{0}")]
    NotReady(String),
    /// No node of that name.
    #[error("no node named {0:?} in this cluster")]
    UnknownNode(String),
}

/// One GPU in a node's `--static-config` file.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StaticGpu {
    /// GPU index.
    pub index: u32,
    /// GPU UUID.
    pub uuid: String,
    /// Product name.
    pub product: String,
    /// Vendor.
    pub vendor: String,
    /// Memory.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Health (the plugin re-reads the file when it changes).
    pub healthy: bool,
}

struct Node {
    name: String,
    /// The kubelet's directory (on a real node, as this host sees it).
    dir: PathBuf,
    static_config: PathBuf,
    gpus: Vec<StaticGpu>,
    /// The simulated kubelet; `None` on a real node, whose kubelet the
    /// cluster's [`RealCluster`] runs.
    kubelet: Option<RunningKubelet>,
    plugin: Option<ChildProcess>,
    /// The plugin's metrics port (a real node's plugin is known to have
    /// registered by its registrations counter).
    plugin_metrics_port: u16,
}

/// A running simulated cluster. Stop it with [`SimCluster::shutdown`];
/// dropping it also stops everything (children are killed).
pub struct SimCluster {
    config: ClusterConfig,
    run_dir: PathBuf,
    created_run_dir: bool,
    kubeconfig: PathBuf,
    apiserver: Option<RunningApiServer>,
    control_plane: Option<ControlPlane>,
    /// The real control plane and nodes, on [`Backend::RealNodes`].
    real: Option<RealCluster>,
    client: Client,
    scheduler: Option<RunningScheduler>,
    nodes: Vec<Node>,
    device_plugin_bin: PathBuf,
    operator_bin: Option<PathBuf>,
    /// One entry per replica; `None` while that replica is not running.
    operators: Vec<Option<OperatorReplica>>,
    /// The operators' webhook address, forwarding to every running replica.
    webhook_proxy: ServiceProxy,
    operator_note: Option<String>,
}

/// A running operator replica and the ports its webhook and metrics serve on.
struct OperatorReplica {
    process: ChildProcess,
    webhook_port: u16,
    metrics_port: u16,
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ClusterError + '_ {
    move |source| ClusterError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn api_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Api { what, source }
}

/// `N` distinct free TCP ports on 127.0.0.1 (see [`ports::free_ports`]).
fn free_ports<const N: usize>() -> Result<[u16; N], ClusterError> {
    ports::free_ports().map_err(|source| ClusterError::Io {
        path: PathBuf::from("127.0.0.1:0"),
        source,
    })
}

/// A run directory no other cluster uses: `gpupool-sim-<pid>-<n>-<stamp>`
/// under the system temp dir (not created here). The per-process counter
/// `n` keeps clusters started at once by one process (parallel tests) apart,
/// where the clock alone may read the same for both; the stamp keeps apart
/// a later process that is given the same pid.
pub fn fresh_run_dir() -> PathBuf {
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stamp = jiff::Timestamp::now().as_nanosecond() % 1_000_000_000;
    std::env::temp_dir().join(format!("gpupool-sim-{}-{n}-{stamp}", std::process::id()))
}

/// The last `lines` lines of a log file, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl SimCluster {
    /// Starts the API server, applies the CRDs, starts the scheduler, the
    /// kubelets, a device plugin per node and (per [`OperatorMode`]) the
    /// operator, and returns once every plugin has registered and
    /// advertised its slots, and the operator (if running) is ready.
    pub async fn start(config: ClusterConfig) -> Result<Self, ClusterError> {
        if config.nodes == 0 {
            return Err(ClusterError::Config("--nodes must be at least 1".into()));
        }
        if config.operator_replicas == 0 {
            return Err(ClusterError::Config(
                "operator replicas must be at least 1".into(),
            ));
        }
        if config.sessions_per_gpu == 0 {
            return Err(ClusterError::Config(
                "--sessions-per-gpu must be at least 1".into(),
            ));
        }
        let device_plugin_bin = find_binary(
            DEVICE_PLUGIN_BIN,
            "--device-plugin-bin",
            config.device_plugin_bin.as_deref(),
        )?;
        let (operator_bin, operator_note) = match config.operator {
            OperatorMode::Off => (None, Some("the operator is off".to_owned())),
            OperatorMode::Required => (
                Some(find_binary(
                    OPERATOR_BIN,
                    "--operator-bin",
                    config.operator_bin.as_deref(),
                )?),
                None,
            ),
            OperatorMode::IfAvailable => {
                match find_binary(
                    OPERATOR_BIN,
                    "--operator-bin",
                    config.operator_bin.as_deref(),
                ) {
                    Ok(p) => (Some(p), None),
                    Err(e) => (None, Some(e.to_string())),
                }
            }
        };

        let (run_dir, created_run_dir) = match &config.run_dir {
            Some(d) => (d.clone(), false),
            None => (fresh_run_dir(), true),
        };
        std::fs::create_dir_all(run_dir.join("logs")).map_err(io_error(&run_dir))?;
        std::fs::create_dir_all(run_dir.join("dev")).map_err(io_error(&run_dir))?;

        let kubeconfig = config
            .kubeconfig
            .clone()
            .unwrap_or_else(|| run_dir.join("kubeconfig"));
        let mut real = None;
        let (apiserver, control_plane, client) = match &config.backend {
            Backend::Simulated => {
                let (apiserver, client) =
                    start_simulated_apiserver(&config, &run_dir, &kubeconfig).await?;
                (Some(apiserver), None, client)
            }
            Backend::RealNodes { assets, images } => {
                let cluster = start_real_nodes(&config, assets, images, &run_dir).await?;
                let client = match cluster_admin(&cluster, &kubeconfig).await {
                    Ok(client) => client,
                    Err(e) => {
                        cluster.shutdown().await;
                        return Err(e);
                    }
                };
                real = Some(cluster);
                (None, None, client)
            }
            Backend::Real { assets } => {
                let mut plane_config =
                    ControlPlaneConfig::new(assets, run_dir.join("control-plane"));
                plane_config.ready_timeout = plane_config.ready_timeout.max(config.ready_timeout);
                let plane = ControlPlane::start(plane_config).await?;
                plane.write_cert_kubeconfig(
                    &kubeconfig,
                    "gpupool-sim-admin",
                    &["system:masters"],
                )?;
                let client = plane.client().await?;
                (None, Some(plane), client)
            }
        };
        let webhook_proxy = ServiceProxy::start()
            .await
            .map_err(|e| ClusterError::NotReady(format!("cannot start the webhook proxy: {e}")))?;
        let mut cluster = SimCluster {
            operators: (0..config.operator_replicas).map(|_| None).collect(),
            webhook_proxy,
            config: config.clone(),
            run_dir,
            created_run_dir,
            kubeconfig,
            apiserver,
            control_plane,
            real,
            client,
            scheduler: None,
            nodes: Vec::new(),
            device_plugin_bin,
            operator_bin,
            operator_note: None,
        };
        // Whatever fails from here on, what was started is stopped again
        // (real nodes also give back what they added to the host).
        match cluster.bring_up(operator_note).await {
            Ok(()) => Ok(cluster),
            Err(e) => {
                if let Err(stop) = cluster.shutdown().await {
                    tracing::warn!(error = %stop, "stopping a cluster that failed to start");
                }
                Err(e)
            }
        }
    }

    /// The rest of [`SimCluster::start`] once the API server runs: the
    /// CRDs and identities, the scheduler, the nodes, their device plugins
    /// and the operator.
    async fn bring_up(&mut self, mut operator_note: Option<String>) -> Result<(), ClusterError> {
        let config = self.config.clone();
        let client = self.client.clone();
        install_crds_and_namespace(&client).await?;
        self.scheduler = match &self.apiserver {
            Some(a) => Some(RunningScheduler::start(
                a.client_with_token(SCHEDULER_TOKEN).await?,
            )),
            None => {
                wait_for_custom_resources(&client, config.ready_timeout).await?;
                install_chart_identities(&client).await?;
                let token = service_account_token(&client, rbac::OPERATOR_NAME, None).await?;
                if let Some(plane) = self.control_plane() {
                    plane.write_token_kubeconfig(
                        &self.run_dir.join("operator.kubeconfig"),
                        &token,
                    )?;
                }
                None
            }
        };

        for i in 1..=config.nodes {
            let name = format!("node-{i}");
            let node_dir = self.run_dir.join(&name);
            std::fs::create_dir_all(&node_dir).map_err(io_error(&node_dir))?;
            let gpus: Vec<StaticGpu> = (0..config.gpus_per_node)
                .map(|g| StaticGpu {
                    index: g,
                    uuid: format!("GPU-sim-{i:04}-{g:04}"),
                    product: "Simulated GPU".into(),
                    vendor: "Simulated".into(),
                    memory_mib: 16_384,
                    healthy: true,
                })
                .collect();
            let static_config = node_dir.join("gpus.yaml");
            write_static_config(&static_config, &gpus)?;
            let (dir, kubelet) = match &self.real {
                Some(real) => {
                    let node = real
                        .nodes()
                        .iter()
                        .find(|n| n.name() == name)
                        .ok_or_else(|| ClusterError::UnknownNode(name.clone()))?;
                    (node.kubelet_dir(), None)
                }
                None => {
                    let kubelet_client = self.kubelet_client(i, &name).await?;
                    let kubelet = RunningKubelet::start(KubeletConfig {
                        node_name: name.clone(),
                        dir: node_dir.clone(),
                        client: kubelet_client,
                        max_termination: config.max_termination,
                        index: i,
                        annotate_allocations: !config.backend.is_real(),
                    })
                    .await?;
                    (node_dir, Some(kubelet))
                }
            };
            self.nodes.push(Node {
                name,
                dir,
                static_config,
                gpus,
                kubelet,
                plugin: None,
                plugin_metrics_port: 0,
            });
        }
        for node in &self
            .nodes
            .iter()
            .map(|n| n.name.clone())
            .collect::<Vec<_>>()
        {
            if let Some(plane) = self.control_plane() {
                // A projected token of a DaemonSet pod: the device plugin's
                // ServiceAccount, bound to (and naming) its node.
                let token =
                    service_account_token(&self.client, rbac::DEVICE_PLUGIN_NAME, Some(node))
                        .await?;
                plane.write_token_kubeconfig(
                    &device_plugin_kubeconfig(&self.run_dir, node),
                    &token,
                )?;
            }
            self.start_plugin(node).await?;
        }
        match self.start_operator().await {
            Ok(()) => {}
            Err(e) if config.operator == OperatorMode::IfAvailable => {
                tracing::warn!(error = %e, "running without the operator");
                operator_note = Some(e.to_string());
            }
            Err(e) => return Err(e),
        }
        if self.operator_note.is_none() {
            self.operator_note = operator_note;
        }
        Ok(())
    }

    /// A client for node `name`'s kubelet: a token of the in-memory server,
    /// or a client certificate as `system:node:<name>` on a real one.
    async fn kubelet_client(&self, index: u32, name: &str) -> Result<Client, ClusterError> {
        if let Some(a) = &self.apiserver {
            return Ok(a
                .client_with_token(&format!("{KUBELET_TOKEN_PREFIX}{index}"))
                .await?);
        }
        let plane = self
            .control_plane()
            .ok_or_else(|| ClusterError::Config("the cluster has been shut down".into()))?;
        let path = self.run_dir.join(format!("kubelet-{name}.kubeconfig"));
        plane.write_cert_kubeconfig(&path, &format!("system:node:{name}"), &["system:nodes"])?;
        Ok(client_from_kubeconfig(&path).await?)
    }

    /// The backend the cluster runs on.
    pub fn backend(&self) -> &Backend {
        &self.config.backend
    }

    /// The real control plane, on [`Backend::Real`] and
    /// [`Backend::RealNodes`].
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self.control_plane
            .as_ref()
            .or_else(|| self.real.as_ref().and_then(RealCluster::control_plane))
    }

    /// The real nodes, on [`Backend::RealNodes`] (their logs, kubelet
    /// directories and IPs).
    pub fn real_nodes(&self) -> Option<&RealCluster> {
        self.real.as_ref()
    }

    /// The in-memory API server (fault controls: `.faults()`, direct
    /// access: `.admin()`); `None` on a real control plane.
    pub fn api_server(&self) -> Option<&RunningApiServer> {
        self.apiserver.as_ref()
    }

    /// A client authenticated as the cluster admin.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The admin kubeconfig (a token, or a client certificate on a real
    /// control plane), usable by kubectl.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The run directory: kubelet dirs `node-i/` (on real nodes, each
    /// node's files are under `real/nodes/node-i/`), logs in `logs/`,
    /// kubeconfigs.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Node names, `node-1` … `node-N`.
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// Slots each node should advertise while all its GPUs are healthy.
    pub fn slots_per_node(&self) -> u64 {
        u64::from(self.config.gpus_per_node) * u64::from(self.config.sessions_per_gpu)
    }

    /// Why the operator is not running, or `None` while it is.
    pub fn operator_note(&self) -> Option<&str> {
        self.operator_note.as_deref()
    }

    /// Whether an operator process is running.
    pub fn operator_running(&mut self) -> bool {
        self.operators
            .iter_mut()
            .flatten()
            .any(|r| r.process.exit_status().is_none())
    }

    /// The Prometheus text of the first running operator replica's
    /// `/metrics`, or `None` when none answers.
    pub async fn operator_metrics(&mut self) -> Option<String> {
        let port = self
            .operators
            .iter_mut()
            .flatten()
            .find_map(|r| r.process.exit_status().is_none().then_some(r.metrics_port))?;
        http_get(port, "/metrics").await
    }

    /// The first running operator replica's PID and metrics port, or
    /// `None` while no replica runs.
    pub fn operator_process(&mut self) -> Option<(u32, u16)> {
        self.operators.iter_mut().flatten().find_map(|r| {
            let pid = r.process.pid()?;
            r.process
                .exit_status()
                .is_none()
                .then_some((pid, r.metrics_port))
        })
    }

    /// PIDs of every child process still running.
    pub fn child_pids(&mut self) -> Vec<u32> {
        let mut pids = Vec::new();
        for p in self
            .nodes
            .iter_mut()
            .filter_map(|n| n.plugin.as_mut())
            .chain(self.operators.iter_mut().flatten().map(|r| &mut r.process))
        {
            if p.exit_status().is_none()
                && let Some(pid) = p.pid()
            {
                pids.push(pid);
            }
        }
        if let Some(real) = &mut self.real {
            pids.extend(real.pids());
        }
        pids
    }

    fn node_index(&self, node: &str) -> Result<usize, ClusterError> {
        self.nodes
            .iter()
            .position(|n| n.name == node)
            .ok_or_else(|| ClusterError::UnknownNode(node.to_owned()))
    }

    /// The node's kubelet directory.
    pub fn node_dir(&self, node: &str) -> Result<&Path, ClusterError> {
        Ok(&self.nodes[self.node_index(node)?].dir)
    }

    /// The node's simulated kubelet (registration count, device
    /// bookkeeping); an error on a real node.
    pub fn kubelet(&self, node: &str) -> Result<&RunningKubelet, ClusterError> {
        self.nodes[self.node_index(node)?]
            .kubelet
            .as_ref()
            .ok_or_else(|| {
                ClusterError::Config(format!(
                    "{node} is a real node: its kubelet is not the simulator's"
                ))
            })
    }

    /// The devices of `resource` that `node`'s kubelet holds for `pod`,
    /// every container's (init containers' included), each once: the
    /// simulated kubelet's bookkeeping, or on a real node its device
    /// manager's checkpoint (`device-plugins/kubelet_internal_checkpoint`).
    /// Empty when it holds none.
    pub fn allocated_devices(
        &self,
        node: &str,
        pod: &k8s_openapi::api::core::v1::Pod,
        resource: &str,
    ) -> Result<std::collections::BTreeSet<String>, ClusterError> {
        let n = &self.nodes[self.node_index(node)?];
        if let Some(kubelet) = &n.kubelet {
            let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            return Ok(kubelet
                .allocated_devices(namespace, name, resource)
                .unwrap_or_default()
                .into_iter()
                .collect());
        }
        let path = n.dir.join("device-plugins/kubelet_internal_checkpoint");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::from("{}"),
            Err(e) => return Err(io_error(&path)(e)),
        };
        let checkpoint: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ClusterError::Io {
                path: path.clone(),
                source: std::io::Error::other(e),
            })?;
        Ok(checkpoint_devices(
            &checkpoint,
            pod.metadata.uid.as_deref().unwrap_or_default(),
            resource,
        ))
    }

    /// The node's GPUs as its static config file has them.
    pub fn gpus(&self, node: &str) -> Result<&[StaticGpu], ClusterError> {
        Ok(&self.nodes[self.node_index(node)?].gpus)
    }

    /// Marks GPU `index` of `node` healthy or not in the node's static
    /// config file; the device plugin notices and tells the kubelet.
    pub fn set_gpu_health(
        &mut self,
        node: &str,
        index: u32,
        healthy: bool,
    ) -> Result<(), ClusterError> {
        let i = self.node_index(node)?;
        let n = &mut self.nodes[i];
        let gpu = n
            .gpus
            .iter_mut()
            .find(|g| g.index == index)
            .ok_or_else(|| ClusterError::Config(format!("{node} has no GPU with index {index}")))?;
        gpu.healthy = healthy;
        write_static_config(&n.static_config, &n.gpus)
    }

    /// Restarts the node's kubelet (sockets in `device-plugins/` are
    /// removed; the plugin must register again).
    pub async fn restart_kubelet(&mut self, node: &str) -> Result<(), ClusterError> {
        let i = self.node_index(node)?;
        match (&mut self.nodes[i].kubelet, &mut self.real) {
            (Some(kubelet), _) => kubelet.restart().await?,
            (None, Some(real)) => {
                real.node_mut(node)
                    .ok_or_else(|| ClusterError::UnknownNode(node.to_owned()))?
                    .restart_kubelet()
                    .await?
            }
            (None, None) => {
                return Err(ClusterError::Config(
                    "the cluster has been shut down".into(),
                ));
            }
        }
        Ok(())
    }

    /// Starts (or restarts) the node's device plugin and waits until it has
    /// registered and its devices are advertised.
    pub async fn start_plugin(&mut self, node: &str) -> Result<(), ClusterError> {
        let i = self.node_index(node)?;
        if let Some(mut old) = self.nodes[i].plugin.take() {
            old.stop(Duration::from_secs(5)).await?;
        }
        let [metrics_port] = free_ports()?;
        self.nodes[i].plugin_metrics_port = metrics_port;
        let n = &self.nodes[i];
        let seen = n.kubelet.as_ref().map_or(0, RunningKubelet::registrations);
        let spec = ProcessSpec {
            name: format!("device-plugin-{}", n.name),
            program: self.device_plugin_bin.clone(),
            args: vec![
                "--kubelet-dir".into(),
                n.dir.clone().into(),
                "--discovery".into(),
                "static".into(),
                "--static-config".into(),
                n.static_config.clone().into(),
                "--node-name".into(),
                n.name.clone().into(),
                "--sessions-per-gpu".into(),
                self.config.sessions_per_gpu.to_string().into(),
                "--metrics-port".into(),
                metrics_port.to_string().into(),
                "--metrics-address".into(),
                "127.0.0.1".into(),
                "--dev-dir".into(),
                self.run_dir.join("dev").into(),
            ],
            env: vec![(
                "KUBECONFIG".into(),
                device_plugin_kubeconfig(&self.run_dir, &n.name).into(),
            )],
        };
        let mut child = ChildProcess::spawn(&spec, &self.run_dir.join("logs"))?;
        let expected = usize::try_from(self.slots_per_node()).unwrap_or(usize::MAX);
        let deadline = Instant::now() + self.config.ready_timeout;
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        let registered = loop {
            let ready = match &n.kubelet {
                Some(kubelet) => {
                    kubelet.registrations() > seen
                        && kubelet.devices(DEFAULT_RESOURCE_NAME).0 >= expected
                }
                // A real kubelet: this plugin process has registered, and
                // the Node's capacity shows its slots.
                None => {
                    plugin_registered(metrics_port).await
                        && node_capacity(&nodes, &n.name).await >= expected
                }
            };
            if ready {
                break true;
            }
            if let Some(status) = child.exit_status() {
                return Err(ClusterError::NotReady(format!(
                    "the device plugin of {} exited ({status}) before registering; its log {} ends with:\n{}",
                    n.name,
                    child.log().display(),
                    log_tail(child.log(), 15)
                )));
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if !registered {
            let log = child.log().to_path_buf();
            let _ = child.stop(Duration::from_secs(2)).await;
            return Err(ClusterError::NotReady(format!(
                "the device plugin of {} did not register {} with its kubelet within {:?}; its log {} ends with:\n{}",
                n.name,
                crate::text::count(self.slots_per_node(), "slot", "slots"),
                self.config.ready_timeout,
                log.display(),
                log_tail(&log, 15)
            )));
        }
        self.nodes[i].plugin = Some(child);
        Ok(())
    }

    /// Kills the node's device plugin with SIGKILL, as a crash would.
    pub async fn kill_plugin(&mut self, node: &str) -> Result<(), ClusterError> {
        let i = self.node_index(node)?;
        if let Some(mut p) = self.nodes[i].plugin.take() {
            p.kill().await?;
        }
        Ok(())
    }

    /// Starts (or restarts) every operator replica, one after the other,
    /// each waited for as [`SimCluster::start_operator_replica`] does.
    pub async fn start_operator(&mut self) -> Result<(), ClusterError> {
        for i in 0..self.operators.len() {
            self.start_operator_replica(i).await?;
        }
        Ok(())
    }

    /// Starts (or restarts) operator replica `i` and waits until its
    /// `/readyz` answers 200 and the MutatingWebhookConfiguration exists.
    pub async fn start_operator_replica(&mut self, i: usize) -> Result<(), ClusterError> {
        let Some(bin) = self.operator_bin.clone() else {
            return Ok(());
        };
        let replicas = self.operators.len();
        let slot = self.operators.get_mut(i).ok_or_else(|| {
            ClusterError::Config(format!("no operator replica {i} of {replicas}"))
        })?;
        if let Some(mut old) = slot.take() {
            old.process.stop(Duration::from_secs(5)).await?;
        }
        self.update_webhook_backends();
        let [webhook_port, metrics_port] = free_ports()?;
        let (name, election) = if replicas == 1 {
            ("operator".to_owned(), vec!["--leader-elect=false".into()])
        } else {
            let identity = operator_identity(i);
            (
                identity.clone(),
                vec![
                    "--leader-elect=true".into(),
                    "--identity".into(),
                    identity.into(),
                ],
            )
        };
        let mut spec = ProcessSpec {
            name,
            program: bin,
            args: vec![
                "--webhook-port".into(),
                webhook_port.to_string().into(),
                "--metrics-port".into(),
                metrics_port.to_string().into(),
                // Loopback only: nothing outside this machine has any
                // business with a simulated cluster's operator.
                "--webhook-bind-address".into(),
                "127.0.0.1".into(),
                "--metrics-bind-address".into(),
                "127.0.0.1".into(),
                "--webhook-url".into(),
                format!("https://{}", self.webhook_proxy.addr()).into(),
                "--namespace".into(),
                OPERATOR_NAMESPACE.into(),
            ],
            env: vec![(
                "KUBECONFIG".into(),
                self.run_dir.join("operator.kubeconfig").into(),
            )],
        };
        spec.args.extend(election);
        if self.control_plane().is_some() {
            // As the chart runs it: its webhook configurations owned by its
            // ClusterRole.
            spec.args.push("--webhook-owner-cluster-role".into());
            spec.args.push(rbac::OPERATOR_NAME.into());
        }
        spec.args
            .extend(self.config.operator_args.iter().map(Into::into));
        let mut child = ChildProcess::spawn(&spec, &self.run_dir.join("logs"))?;
        let webhooks: Api<MutatingWebhookConfiguration> = Api::all(self.client.clone());
        let deadline = Instant::now() + self.config.ready_timeout;
        loop {
            if http_status(metrics_port, "/readyz").await == Some(200)
                && webhooks
                    .get_opt(gpupool_api::names::WEBHOOK_CONFIGURATION)
                    .await
                    .ok()
                    .flatten()
                    .is_some()
            {
                break;
            }
            if let Some(status) = child.exit_status() {
                return Err(ClusterError::NotReady(format!(
                    "the operator exited ({status}) before becoming ready; its log {} ends with:\n{}",
                    child.log().display(),
                    log_tail(child.log(), 15)
                )));
            }
            if Instant::now() >= deadline {
                let log = child.log().to_path_buf();
                let _ = child.stop(Duration::from_secs(2)).await;
                return Err(ClusterError::NotReady(format!(
                    "the operator did not become ready (/readyz and its webhook configuration) within {:?}; its log {} ends with:\n{}",
                    self.config.ready_timeout,
                    log.display(),
                    log_tail(&log, 15)
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.operators[i] = Some(OperatorReplica {
            process: child,
            webhook_port,
            metrics_port,
        });
        self.update_webhook_backends();
        self.operator_note = None;
        Ok(())
    }

    /// Kills every operator replica with SIGKILL, as a crash would.
    pub async fn kill_operator(&mut self) -> Result<(), ClusterError> {
        for i in 0..self.operators.len() {
            self.kill_operator_replica(i).await?;
        }
        Ok(())
    }

    /// Kills operator replica `i` with SIGKILL, as a crash would.
    pub async fn kill_operator_replica(&mut self, i: usize) -> Result<(), ClusterError> {
        if let Some(mut r) = self.operators.get_mut(i).and_then(Option::take) {
            r.process.kill().await?;
        }
        self.update_webhook_backends();
        if !self.operator_running() {
            self.operator_note = Some("the operator was killed".into());
        }
        Ok(())
    }

    /// The replica holding the leader-election Lease, when one does and
    /// several replicas run (a single replica does not elect).
    pub async fn operator_leader(&self) -> Result<Option<usize>, ClusterError> {
        let leases: Api<CoordinationLease> =
            Api::namespaced(self.client.clone(), OPERATOR_NAMESPACE);
        let lease = leases
            .get_opt(gpupool_api::names::LEADER_ELECTION_LEASE)
            .await
            .map_err(api_error("reading the leader-election Lease"))?;
        let holder = lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .unwrap_or_default();
        Ok((0..self.operators.len()).find(|i| operator_identity(*i) == holder))
    }

    /// Points the webhook address at the replicas now running.
    fn update_webhook_backends(&mut self) {
        let backends = self
            .operators
            .iter_mut()
            .flatten()
            .filter_map(|r| {
                r.process
                    .exit_status()
                    .is_none()
                    .then(|| std::net::SocketAddr::from(([127, 0, 0, 1], r.webhook_port)))
            })
            .collect();
        self.webhook_proxy.set_backends(backends);
    }

    /// Stops every child (SIGTERM, then SIGKILL after 5 s), the kubelets,
    /// the scheduler and the API server, and removes a run directory it
    /// created when so configured.
    pub async fn shutdown(mut self) -> Result<(), ClusterError> {
        let mut first_error = None;
        for mut op in self.operators.iter_mut().filter_map(Option::take) {
            if let Err(e) = op.process.stop(Duration::from_secs(5)).await {
                first_error.get_or_insert(e);
            }
        }
        for node in &mut self.nodes {
            if let Some(mut p) = node.plugin.take()
                && let Err(e) = p.stop(Duration::from_secs(5)).await
            {
                first_error.get_or_insert(e);
            }
        }
        for node in std::mem::take(&mut self.nodes) {
            if let Some(kubelet) = node.kubelet {
                kubelet.stop().await;
            }
        }
        if let Some(real) = self.real.take() {
            // Deletes the nodes' pods, stops the nodes and the control
            // plane, and removes what they added to the host.
            real.shutdown().await;
        }
        if let Some(s) = self.scheduler.take() {
            s.stop().await;
        }
        if let Some(a) = self.apiserver.take() {
            a.shutdown().await;
        }
        if let Some(p) = self.control_plane.take()
            && let Err(e) = p.stop().await
        {
            tracing::warn!(error = %e, "stopping the control plane");
        }
        if self.created_run_dir && self.config.remove_run_dir {
            let _ = std::fs::remove_dir_all(&self.run_dir);
        }
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        // Children are killed by their handles' drop; remove what we created,
        // unless a test is failing: then its logs are worth keeping.
        let running =
            self.apiserver.is_some() || self.control_plane.is_some() || self.real.is_some();
        if self.created_run_dir && self.config.remove_run_dir && running {
            if std::thread::panicking() {
                eprintln!(
                    "simulated cluster run directory kept for its logs: {}",
                    self.run_dir.display()
                );
            } else {
                let _ = std::fs::remove_dir_all(&self.run_dir);
            }
        }
    }
}

/// Starts the in-memory API server with a token per identity of the
/// simulated cluster, and writes the admin, operator and device-plugin
/// kubeconfigs.
async fn start_simulated_apiserver(
    config: &ClusterConfig,
    run_dir: &Path,
    kubeconfig: &Path,
) -> Result<(RunningApiServer, Client), ClusterError> {
    let mut api_config = ApiServerConfig {
        port: config.port,
        ..Default::default()
    }
    .with_token(
        OPERATOR_TOKEN,
        OPERATOR_USER,
        &[
            "system:serviceaccounts",
            "system:serviceaccounts:gpupool-system",
        ],
    )
    .with_token(SCHEDULER_TOKEN, "system:kube-scheduler", &[]);
    for i in 1..=config.nodes {
        api_config = api_config.with_user(
            &format!("{DEVICE_PLUGIN_TOKEN_PREFIX}{i}"),
            UserInfo::new(
                DEVICE_PLUGIN_USER,
                &[
                    "system:serviceaccounts",
                    "system:serviceaccounts:gpupool-system",
                ],
            )
            .with_extra(NODE_NAME_EXTRA, &[&format!("node-{i}")]),
        );
        api_config = api_config.with_token(
            &format!("{KUBELET_TOKEN_PREFIX}{i}"),
            &format!("system:node:node-{i}"),
            &["system:nodes"],
        );
    }
    let apiserver = ApiServer::start(api_config).await?;
    apiserver.write_kubeconfig(kubeconfig, ADMIN_TOKEN)?;
    apiserver.write_kubeconfig(&run_dir.join("operator.kubeconfig"), OPERATOR_TOKEN)?;
    for i in 1..=config.nodes {
        apiserver.write_kubeconfig(
            &device_plugin_kubeconfig(run_dir, &format!("node-{i}")),
            &format!("{DEVICE_PLUGIN_TOKEN_PREFIX}{i}"),
        )?;
    }
    let client = apiserver.client().await?;
    Ok((apiserver, client))
}

/// Starts a real control plane with `config.nodes` real nodes named
/// `node-1` … in `run_dir/real`, with the pause and workload images of
/// `images` loaded.
async fn start_real_nodes(
    config: &ClusterConfig,
    assets: &Path,
    images: &Path,
    run_dir: &Path,
) -> Result<RealCluster, ClusterError> {
    if assets.as_os_str().is_empty() {
        return Err(ClusterError::Config(
            "real nodes need KUBEBUILDER_ASSETS (bash .ci/install-k8s.sh)".into(),
        ));
    }
    if images.as_os_str().is_empty() {
        return Err(ClusterError::Config(format!(
            "real nodes need {IMAGES_ENV} (bash .ci/build-images.sh)"
        )));
    }
    // Only what pods run: the operator and device plugin run on this host.
    let wanted = ["gpupool-pause.tar", "gpupool-workload.tar"];
    let archives: Vec<PathBuf> = crate::real_node::image_archives(images)?
        .into_iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| wanted.iter().any(|w| n == std::ffi::OsStr::new(w)))
        })
        .collect();
    if archives.len() != wanted.len() {
        return Err(ClusterError::Config(format!(
            "real nodes need {} in {} (bash .ci/build-images.sh)",
            wanted.join(" and "),
            images.display()
        )));
    }
    let real_config = RealClusterConfig {
        assets: assets.to_path_buf(),
        dir: run_dir.join("real"),
        nodes: config.nodes,
        images: archives,
        ready_timeout: config.ready_timeout.max(Duration::from_secs(90)),
        node_prefix: "node-".to_owned(),
    };
    Ok(RealCluster::start(real_config).await?)
}

/// Writes the admin kubeconfig of a cluster with real nodes to
/// `kubeconfig` and returns an admin client.
async fn cluster_admin(cluster: &RealCluster, kubeconfig: &Path) -> Result<Client, ClusterError> {
    let plane = cluster
        .control_plane()
        .ok_or_else(|| ClusterError::NotReady("the control plane is not running".into()))?;
    plane.write_cert_kubeconfig(kubeconfig, "gpupool-sim-admin", &["system:masters"])?;
    Ok(plane.client().await?)
}

/// Whether the device plugin serving metrics on `port` has registered with
/// its kubelet at least once.
async fn plugin_registered(port: u16) -> bool {
    http_get(port, "/metrics").await.is_some_and(|text| {
        text.lines().any(|l| {
            l.starts_with("gpupool_device_plugin_registrations_total{result=\"ok\"}")
                && l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v >= 1.0)
        })
    })
}

/// The slots Node `name`'s capacity shows (0 when unknown).
async fn node_capacity(nodes: &Api<k8s_openapi::api::core::v1::Node>, name: &str) -> usize {
    let Ok(Some(node)) = nodes.get_opt(name).await else {
        return 0;
    };
    node.status
        .and_then(|s| s.capacity)
        .and_then(|c| c.get(DEFAULT_RESOURCE_NAME).map(|q| q.0.clone()))
        .and_then(|q| q.parse().ok())
        .unwrap_or(0)
}

/// The devices of `resource` a kubelet's device-manager checkpoint
/// records for the pod of `uid`: its entries (one per container) carry
/// `DeviceIDs` by NUMA node.
fn checkpoint_devices(
    checkpoint: &serde_json::Value,
    uid: &str,
    resource: &str,
) -> std::collections::BTreeSet<String> {
    checkpoint["Data"]["PodDeviceEntries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["PodUID"] == uid && e["ResourceName"] == resource)
        .filter_map(|e| e["DeviceIDs"].as_object())
        .flat_map(|by_numa| by_numa.values())
        .filter_map(serde_json::Value::as_array)
        .flatten()
        .filter_map(|d| d.as_str().map(str::to_owned))
        .collect()
}

/// The kubeconfig of `node`'s device plugin in the run directory.
fn device_plugin_kubeconfig(run_dir: &Path, node: &str) -> PathBuf {
    run_dir.join(format!("device-plugin-{node}.kubeconfig"))
}

/// Leader-election identity of operator replica `i`.
fn operator_identity(i: usize) -> String {
    format!("operator-{i}")
}

fn write_static_config(path: &Path, gpus: &[StaticGpu]) -> Result<(), ClusterError> {
    let text = serde_yaml::to_string(gpus).map_err(|e| ClusterError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    // Write then rename, so the plugin never reads a half-written file.
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, text).map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_error(path))
}

async fn install_crds_and_namespace(client: &Client) -> Result<(), ClusterError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [GpuLeaseClass::crd(), GpuLease::crd()] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        match crds.create(&PostParams::default(), &crd).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(api_error(format!("creating CRD {name}"))(e)),
        }
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(OPERATOR_NAMESPACE.into()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                OPERATOR_NAMESPACE.to_owned(),
            )])),
            ..Default::default()
        },
        ..Default::default()
    };
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(api_error(format!(
            "creating namespace {OPERATOR_NAMESPACE}"
        ))(e)),
    }
}

/// Status code of `GET path` on 127.0.0.1:`port`, or `None` if it does not
/// answer within 2 seconds.
pub async fn http_status(port: u16, path: &str) -> Option<u16> {
    http_request(port, path, Duration::from_secs(2))
        .await
        .map(|(status, _)| status)
}

/// The body of a plain-HTTP GET of `path` on 127.0.0.1:`port`, when it
/// answers 200 within 5 seconds.
pub async fn http_get(port: u16, path: &str) -> Option<String> {
    match http_request(port, path, Duration::from_secs(5)).await {
        Some((200, body)) => Some(body),
        _ => None,
    }
}

/// Status code and body of one `GET path` (the connection is closed after it).
async fn http_request(port: u16, path: &str, timeout: Duration) -> Option<(u16, String)> {
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        let text = String::from_utf8_lossy(&response);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, body.to_owned()))
    };
    tokio::time::timeout(timeout, attempt).await.ok().flatten()
}

/// Waits until both custom resources can be watched: a real API server
/// serves a new CRD only once it is Established, and answers watches with
/// 429 "storage is (re)initializing" until its watch cache has filled. A
/// client that starts watching earlier sees those errors (as the operator's
/// first watches would), which `helm install` avoids by creating CRDs
/// before anything that uses them.
async fn wait_for_custom_resources(client: &Client, timeout: Duration) -> Result<(), ClusterError> {
    let deadline = Instant::now() + timeout;
    let leases: Api<GpuLease> = Api::all(client.clone());
    let classes: Api<GpuLeaseClass> = Api::all(client.clone());
    let params = kube::api::WatchParams::default().timeout(1);
    loop {
        let lease_watch = leases.watch(&params, "0").await;
        let class_watch = classes.watch(&params, "0").await;
        match (lease_watch, class_watch) {
            (Ok(_), Ok(_)) => return Ok(()),
            (Err(e), _) | (_, Err(e)) if Instant::now() >= deadline => {
                return Err(ClusterError::NotReady(format!(
                    "the gpupool CRDs were not served within {timeout:?}: {e}"
                )));
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The chart's ServiceAccounts and RBAC for the operator and the device
/// plugin, in the operator's namespace (a real control plane only: the
/// in-memory server does not enforce RBAC).
async fn install_chart_identities(client: &Client) -> Result<(), ClusterError> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    for name in [rbac::OPERATOR_NAME, rbac::DEVICE_PLUGIN_NAME] {
        let sa: ServiceAccount = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": OPERATOR_NAMESPACE}
        }))
        .map_err(|e| ClusterError::Config(format!("ServiceAccount {name}: {e}")))?;
        match accounts.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(api_error(format!("creating ServiceAccount {name}"))(e)),
        }
    }
    let mut objects =
        rbac::operator(OPERATOR_NAMESPACE).map_err(|e| ClusterError::Config(e.to_string()))?;
    objects.extend(
        rbac::device_plugin(OPERATOR_NAMESPACE).map_err(|e| ClusterError::Config(e.to_string()))?,
    );
    let params = PatchParams::apply("gpupool-sim").force();
    for object in objects {
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let resource = ApiResource {
            group: "rbac.authorization.k8s.io".into(),
            version: "v1".into(),
            api_version: "rbac.authorization.k8s.io/v1".into(),
            kind: kind.clone(),
            plural: format!("{}s", kind.to_lowercase()),
        };
        let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        api.patch(&name, &params, &Patch::Apply(&object))
            .await
            .map_err(api_error(format!("applying the chart's {kind} {name}")))?;
    }
    Ok(())
}

/// A token of ServiceAccount `name` in the operator's namespace, valid for a
/// day; bound to Node `node` when given, so it carries the node's name as a
/// DaemonSet pod's projected token does.
async fn service_account_token(
    client: &Client,
    name: &str,
    node: Option<&str>,
) -> Result<String, ClusterError> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    let mut spec = serde_json::json!({"expirationSeconds": 86_400});
    if let Some(node) = node {
        spec["boundObjectRef"] =
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "name": node});
    }
    let request: TokenRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec,
    }))
    .map_err(|e| ClusterError::Config(format!("a TokenRequest for {name}: {e}")))?;
    let answer = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(api_error(format!(
            "requesting a token of ServiceAccount {name}"
        )))?;
    answer
        .status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            ClusterError::Config(format!("the token request for {name} returned no token"))
        })
}

#[cfg(test)]
mod tests {
    use super::fresh_run_dir;

    #[test]
    fn a_checkpoint_lists_every_container_of_the_pod_once() {
        let checkpoint = serde_json::json!({"Data": {"PodDeviceEntries": [
            {"PodUID": "u1", "ContainerName": "setup", "ResourceName": "gpupool/slot",
             "DeviceIDs": {"-1": ["a", "b"]}},
            {"PodUID": "u1", "ContainerName": "work", "ResourceName": "gpupool/slot",
             "DeviceIDs": {"-1": ["a"]}},
            {"PodUID": "u1", "ContainerName": "side", "ResourceName": "gpupool/slot",
             "DeviceIDs": {"0": ["c"]}},
            {"PodUID": "u2", "ContainerName": "work", "ResourceName": "gpupool/slot",
             "DeviceIDs": {"-1": ["d"]}},
            {"PodUID": "u1", "ContainerName": "work", "ResourceName": "other/thing",
             "DeviceIDs": {"-1": ["e"]}},
        ]}});
        let got: Vec<String> = super::checkpoint_devices(&checkpoint, "u1", "gpupool/slot")
            .into_iter()
            .collect();
        assert_eq!(got, ["a", "b", "c"]);
        assert!(super::checkpoint_devices(&serde_json::json!({}), "u1", "gpupool/slot").is_empty());
    }

    #[test]
    fn run_dirs_taken_at_once_by_one_process_differ() {
        let dirs: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(fresh_run_dir)).collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        let distinct: std::collections::HashSet<_> = dirs.iter().collect();
        assert_eq!(distinct.len(), dirs.len(), "{dirs:?}");
    }
}
