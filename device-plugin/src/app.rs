//! Wiring: discovery feeds the slot table, which the kubelet service,
//! metrics and reporter read; everything stops when the shutdown token fires.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::cli::{DiscoverySource, Settings};
use crate::discovery::nvml::{LiveNvml, NvmlDiscovery};
use crate::discovery::static_config::{StaticDiscovery, synthesise};
use crate::discovery::{self, Discovery, DiscoveryError, Gpu, NoGpus};
use crate::metrics::{self, Metrics};
use crate::registration::{Lifecycle, LifecycleError};
use crate::reporter::Reporter;
use crate::server::DevicePluginService;
use crate::slots::SlotTable;

/// Why the plugin could not run.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Discovery failed (a bad static config is a configuration error).
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// The plugin socket could not be served.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    /// The async runtime could not be started.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The metrics port could not be opened.
    #[error("--metrics-port: cannot listen on {addr}: {source}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

impl AppError {
    /// True when the user's configuration is at fault (exit code 2).
    pub fn is_config_error(&self) -> bool {
        matches!(self, AppError::Discovery(e) if e.is_config_error())
    }
}

fn open_backend(
    source: &DiscoverySource,
    node_name: &str,
) -> Result<Box<dyn Discovery>, DiscoveryError> {
    Ok(match source {
        DiscoverySource::Nvml => Box::new(NvmlDiscovery::new(LiveNvml::open()?)?),
        DiscoverySource::Auto => match LiveNvml::open() {
            Ok(nvml) => Box::new(NvmlDiscovery::new(nvml)?),
            Err(e) => {
                tracing::warn!(error = %e, "--discovery auto: no NVIDIA library; this node has no GPUs to advertise");
                Box::new(NoGpus::new(Duration::from_secs(60)))
            }
        },
        DiscoverySource::StaticCount(n) => Box::new(StaticDiscovery::fixed(
            synthesise(*n, node_name)
                .into_iter()
                .map(Gpu::from)
                .collect(),
        )),
        DiscoverySource::StaticFile(path) => Box::new(StaticDiscovery::file(path.clone())),
    })
}

/// Starts discovery and returns the live slot table. Blocks until the first
/// GPU list is known, so errors surface before anything is served; a
/// `--devices` entry naming a GPU the node lacks is a configuration error.
pub fn start_discovery(
    settings: &Settings,
    metrics: &Metrics,
) -> Result<watch::Receiver<Arc<SlotTable>>, DiscoveryError> {
    let sessions = settings.sessions_per_gpu;
    let (tx, rx) = watch::channel(Arc::new(SlotTable::new(Vec::new(), sessions)));
    let source = settings.discovery.clone();
    let node_name = settings.node_name.clone().unwrap_or_default();
    let publisher = tx.clone();
    let thread_metrics = metrics.clone();
    let first = discovery::spawn_monitor(
        move || open_backend(&source, &node_name),
        settings.filter.clone(),
        move |gpus| {
            let table = SlotTable::new(gpus.to_vec(), sessions);
            thread_metrics.observe_table(&table);
            publisher.send_replace(Arc::new(table));
            true
        },
    )?;
    tracing::info!(strategies = %settings.listing.strategies, cdi_kind = %settings.listing.cdi_kind, "device list strategy");
    if first.is_empty() {
        tracing::warn!(
            discovery = %settings.discovery,
            "no GPUs found: advertising zero {} devices and serving the kubelet anyway",
            settings.resource_name
        );
    } else {
        tracing::info!(
            gpus = first.len(),
            slots = first.len() * sessions as usize,
            indices = %gpupool_api::index_list(first.iter().map(|g| g.node.index)),
            "GPUs discovered"
        );
    }
    let table = SlotTable::new(first, sessions);
    metrics.observe_table(&table);
    tx.send_replace(Arc::new(table));
    Ok(rx)
}

/// Runs the plugin until `shutdown` fires: metrics endpoint, reporter, and
/// the kubelet lifecycle (which removes the plugin socket on the way out).
pub async fn run(
    settings: Settings,
    table: watch::Receiver<Arc<SlotTable>>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), AppError> {
    let listener = metrics::bind(settings.metrics_addr)
        .await
        .map_err(|source| AppError::Metrics {
            addr: settings.metrics_addr,
            source,
        })?;
    match listener.local_addr() {
        Ok(addr) => tracing::info!(%addr, "serving /metrics and /healthz"),
        Err(e) => tracing::warn!(error = %e, "serving /metrics and /healthz on an unknown address"),
    }
    tokio::spawn(metrics::serve(listener, metrics.clone(), shutdown.clone()));

    let reporter = Reporter {
        kubelet_dir: settings.kubelet_dir.clone(),
        resource_name: settings.resource_name.clone(),
        node_name: settings.node_name.clone(),
        table: table.clone(),
        metrics: metrics.clone(),
    };
    tokio::spawn(reporter.run(shutdown.clone()));

    let service_table = table;
    let dev_dir = settings.dev_dir.clone();
    let listing = settings.listing.clone();
    let service_metrics = metrics.clone();
    let lifecycle = Lifecycle {
        kubelet_dir: settings.kubelet_dir,
        resource_name: settings.resource_name,
        service: Box::new(move |stop| {
            DevicePluginService::new(
                service_table.clone(),
                dev_dir.clone(),
                listing.clone(),
                service_metrics.clone(),
                stop,
            )
        }),
        metrics,
    };
    lifecycle.run(shutdown).await?;
    Ok(())
}
