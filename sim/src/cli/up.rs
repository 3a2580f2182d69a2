//! `gpupool-sim up`: runs the simulated cluster until SIGTERM/SIGINT/SIGHUP.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::detach::{self, PidFile};
use super::logging;
use crate::cluster::admin;
use crate::cluster::sim::fresh_run_dir;
use crate::cluster::{Backend, ClusterConfig, OperatorMode, SimCluster};
use crate::real_node::{RealCluster, RealClusterConfig};

/// Whether `up` runs the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OperatorFlag {
    /// Run it when its binary is found and becomes ready; otherwise say so and go on.
    Auto,
    /// Run it; fail to start without it.
    On,
    /// Do not run it.
    Off,
}

/// Arguments of `gpupool-sim up`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of nodes (node-1 … node-N).
    #[arg(long, env = "GPUPOOL_SIM_NODES", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub nodes: u32,

    /// GPUs per node.
    #[arg(long, env = "GPUPOOL_SIM_GPUS_PER_NODE", default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub gpus_per_node: u32,

    /// Slots per GPU (the device plugins' --sessions-per-gpu).
    #[arg(long, env = "GPUPOOL_SIM_SESSIONS_PER_GPU", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub sessions_per_gpu: u32,

    /// API server port on 127.0.0.1 (0 picks a free one).
    #[arg(long, env = "GPUPOOL_SIM_PORT", default_value_t = 0)]
    pub port: u16,

    /// Where to write the admin kubeconfig (default: RUN_DIR/kubeconfig).
    #[arg(long, env = "GPUPOOL_SIM_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Run directory for kubelet dirs, logs and kubeconfigs (default: a new
    /// directory under the system temp dir, or with --detach the one
    /// `gpupool-sim down` stops by default; kept after exit).
    #[arg(long, env = "GPUPOOL_SIM_RUN_DIR", value_name = "DIR")]
    pub run_dir: Option<PathBuf>,

    /// The gpupool-operator binary (default: next to gpupool-sim).
    #[arg(long, env = "GPUPOOL_SIM_OPERATOR_BIN")]
    pub operator_bin: Option<PathBuf>,

    /// The gpupool-device-plugin binary (default: next to gpupool-sim).
    #[arg(long, env = "GPUPOOL_SIM_DEVICE_PLUGIN_BIN")]
    pub device_plugin_bin: Option<PathBuf>,

    /// Whether to run the operator.
    #[arg(long, env = "GPUPOOL_SIM_OPERATOR", value_enum, default_value_t = OperatorFlag::Auto)]
    pub operator: OperatorFlag,

    /// Port of the fault-control endpoint on 127.0.0.1 (0 picks a free one).
    #[arg(long, env = "GPUPOOL_SIM_ADMIN_PORT", default_value_t = 0)]
    pub admin_port: u16,

    /// Seconds a deleted pod stays Terminating at most (its grace period, capped).
    #[arg(
        long,
        env = "GPUPOOL_SIM_MAX_TERMINATION_SECONDS",
        default_value_t = 1.0
    )]
    pub max_termination_seconds: f64,

    /// Run on a real Kubernetes control plane from this envtest assets
    /// directory (etcd, kube-apiserver, kube-scheduler,
    /// kube-controller-manager) instead of the in-memory API server; the
    /// simulator then runs only the kubelets, device plugins and operator.
    #[arg(long = "kube-assets", env = "KUBEBUILDER_ASSETS", value_name = "DIR")]
    pub kube_assets: Option<PathBuf>,

    /// Run this many real nodes (a Debian containerd and a real kubelet
    /// each, on this machine) instead of simulated ones; needs
    /// --kube-assets (with the kubelet beside the control plane), root,
    /// containerd, runc, iptables and the CNI plugins. Neither the operator
    /// nor device plugins are started: install the chart (see
    /// docs/operations.md).
    #[arg(long, env = "GPUPOOL_SIM_REAL_NODES", value_name = "N", requires = "kube_assets", value_parser = clap::value_parser!(u32).range(1..=8))]
    pub real_nodes: Option<u32>,

    /// With --real-nodes: the directory of image tarballs to load into each
    /// node's containerd (what `.ci/build-images.sh` writes).
    #[arg(
        long,
        env = "GPUPOOL_IMAGES_DIR",
        value_name = "DIR",
        default_value = ".tools/images"
    )]
    pub images: PathBuf,

    /// Start the cluster in the background: return once it is ready,
    /// printing `export KUBECONFIG=...`; `gpupool-sim down` stops it.
    #[arg(long)]
    pub detach: bool,
}

impl Args {
    /// The run directory: --run-dir, else with --detach the per-user one
    /// `down` looks in ([`detach::default_run_dir`]), else a fresh one.
    pub fn resolved_run_dir(&self) -> PathBuf {
        match &self.run_dir {
            Some(dir) => dir.clone(),
            None if self.detach => detach::default_run_dir(),
            None => fresh_run_dir(),
        }
    }

    /// How long start-up may take before the cluster counts as failed.
    pub fn ready_timeout(&self) -> Duration {
        match (self.real_nodes, &self.kube_assets) {
            // The control plane, then each node's images and kubelet.
            (Some(n), _) => Duration::from_secs(90 + 60 * u64::from(n)),
            (None, Some(_)) => Duration::from_secs(90),
            (None, None) => Duration::from_secs(30),
        }
    }

    /// The cluster these flags describe.
    pub fn cluster_config(&self) -> anyhow::Result<ClusterConfig> {
        if !(self.max_termination_seconds.is_finite() && self.max_termination_seconds >= 0.0) {
            anyhow::bail!(
                "--max-termination-seconds must be a non-negative number, got {}",
                self.max_termination_seconds
            );
        }
        Ok(ClusterConfig {
            backend: backend(self.kube_assets.as_ref()),
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            sessions_per_gpu: self.sessions_per_gpu,
            port: self.port,
            run_dir: self.run_dir.clone(),
            remove_run_dir: false,
            kubeconfig: self.kubeconfig.clone(),
            device_plugin_bin: self.device_plugin_bin.clone(),
            operator_bin: self.operator_bin.clone(),
            operator: match self.operator {
                OperatorFlag::Auto => OperatorMode::IfAvailable,
                OperatorFlag::On => OperatorMode::Required,
                OperatorFlag::Off => OperatorMode::Off,
            },
            max_termination: Duration::from_secs_f64(self.max_termination_seconds),
            ready_timeout: self.ready_timeout(),
            ..ClusterConfig::default()
        })
    }
}

/// The backend `--kube-assets` asks for: a real control plane from that
/// directory, else the in-memory API server. An empty value counts as unset.
pub fn backend(kube_assets: Option<&PathBuf>) -> Backend {
    match kube_assets.filter(|p| !p.as_os_str().is_empty()) {
        Some(assets) => Backend::Real {
            assets: assets.clone(),
        },
        None => Backend::Simulated,
    }
}

/// Runs a real control plane with real nodes until a signal, then tears it
/// down (pods first).
async fn run_real_nodes(config: RealClusterConfig) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    eprintln!(
        "gpupool-sim: run directory {}; starting a real control plane and {} real node(s)",
        config.dir.display(),
        config.nodes
    );
    let cluster = tokio::select! {
        started = RealCluster::start(config) => started.context("starting the real nodes")?,
        _ = term.recv() => return Ok(()),
        _ = int.recv() => return Ok(()),
        _ = hup.recv() => return Ok(()),
    };
    let kubeconfig = cluster
        .kubeconfig()
        .context("internal: a started cluster has a kubeconfig")?
        .to_path_buf();
    for node in cluster.nodes() {
        eprintln!(
            "gpupool-sim: {} at {}: kubelet directory {} (the chart's devicePlugin.kubeletDir), logs in {}",
            node.name(),
            node.ip(),
            node.kubelet_dir().display(),
            node.logs().display()
        );
    }
    let announced = {
        let mut stdout = std::io::stdout();
        writeln!(stdout, "ready kubeconfig={}", kubeconfig.display()).and_then(|()| stdout.flush())
    };
    if announced.is_ok() {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
            _ = hup.recv() => {}
        }
    }
    eprintln!("gpupool-sim: stopping (deleting the nodes' pods first)");
    cluster.shutdown().await;
    announced.context("writing the ready line to stdout")?;
    Ok(())
}

/// Runs `gpupool-sim up` in the foreground (a detached cluster is this
/// too, started by [`detach::launch`]): `args.run_dir` must be set, and
/// logging already sent to its `logs/`.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = args.cluster_config()?;
    let run_dir = config
        .run_dir
        .clone()
        .context("internal: `up` runs with its run directory resolved")?;
    detach::refuse_if_running(&run_dir)?;
    let _pid_file = PidFile::write(&run_dir)?;
    if let (Some(nodes), Some(assets)) = (args.real_nodes, &args.kube_assets) {
        let config = RealClusterConfig {
            ready_timeout: args.ready_timeout(),
            ..RealClusterConfig::new(assets, &run_dir, nodes, &args.images)?
        };
        return run_real_nodes(config).await;
    }
    // Signals are caught from the start, so a SIGTERM during start-up still
    // stops every child.
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    eprintln!(
        "gpupool-sim: run directory {}; logs in {} (RUST_LOG sets their level)",
        run_dir.display(),
        run_dir.join(logging::LOG_DIR).display()
    );
    let mut cluster = tokio::select! {
        started = SimCluster::start(config) => started.context("starting the simulated cluster")?,
        _ = term.recv() => return Ok(()),
        _ = int.recv() => return Ok(()),
        _ = hup.recv() => return Ok(()),
    };
    let listener = match tokio::net::TcpListener::bind(("127.0.0.1", args.admin_port)).await {
        Ok(l) => l,
        Err(e) => {
            let _ = cluster.shutdown().await;
            return Err(e)
                .with_context(|| format!("--admin-port {}: cannot listen", args.admin_port));
        }
    };
    let admin_url = format!("http://{}", listener.local_addr().context("admin address")?);
    let admin_file = cluster.run_dir().join("admin-url");
    std::fs::write(&admin_file, &admin_url)
        .with_context(|| format!("writing {}", admin_file.display()))?;
    let cancel = CancellationToken::new();
    let (tx, mut commands) = mpsc::channel(8);
    let server = tokio::spawn(admin::serve(listener, tx, cancel.clone()));

    if let Some(plane) = cluster.control_plane() {
        eprintln!(
            "gpupool-sim: real control plane {} (its logs in control-plane/logs/)",
            plane.url()
        );
    }
    if let Some(api) = cluster.api_server() {
        eprintln!("gpupool-sim: API server {}", api.base_url());
    }
    eprintln!(
        "gpupool-sim: fault controls {admin_url}/sim/... (the address is also in {})",
        admin_file.display()
    );
    match cluster.operator_note() {
        None => eprintln!("gpupool-sim: operator running"),
        Some(note) => eprintln!(
            "gpupool-sim: the operator is NOT running ({note}); pods are scheduled without gpupool's queue"
        ),
    }
    // Whoever reads this line (a terminal, a test, `up --detach` waiting
    // for it) may be gone; then nobody can use the cluster: stop it.
    let announced = {
        let mut stdout = std::io::stdout();
        writeln!(
            stdout,
            "ready kubeconfig={}",
            cluster.kubeconfig().display()
        )
        .and_then(|()| stdout.flush())
    };
    if let Err(e) = &announced {
        tracing::warn!(error = %e, "nobody reads the ready line; stopping");
    } else {
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = hup.recv() => break,
                Some(request) = commands.recv() => {
                    let answer = cluster.apply(request.command).await;
                    let _ = request.reply.send(answer);
                }
            }
        }
    }
    eprintln!("gpupool-sim: stopping");
    cancel.cancel();
    let _ = server.await;
    cluster
        .shutdown()
        .await
        .context("stopping the simulated cluster")?;
    announced.context("writing the ready line to stdout")?;
    Ok(())
}
