//! A simulated kubelet for one node. It speaks the kubelet's real gRPC
//! protocols to the real device plugin — `Registration` on
//! `<dir>/device-plugins/kubelet.sock`, the plugin's `DevicePlugin` service,
//! and PodResources v1 on `<dir>/pod-resources/kubelet.sock` — and plays the
//! node's part towards the API server: it creates the Node, keeps its device
//! capacity current, and runs the pods bound to it (no containers: a pod is
//! Running once its devices are allocated).

pub mod admission;
pub mod devices;
pub mod node;
pub mod plugins;
pub mod podresources;
pub mod pods;
pub mod registration;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpupool_kubelet_api::proto::deviceplugin::v1beta1::registration_server::RegistrationServer;
use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
    Device, DevicePluginOptions, RegisterRequest,
};
use gpupool_kubelet_api::proto::podresources::v1::pod_resources_lister_server::PodResourcesListerServer;
use gpupool_kubelet_api::transport::{TransportError, bind_unix, serve_incoming};
use kube::Client;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use devices::DeviceBook;
use plugins::PluginEndpoint;

/// Directory under the kubelet dir holding the device-plugin sockets.
pub const DEVICE_PLUGINS_DIR: &str = "device-plugins";
/// The kubelet's registration socket inside [`DEVICE_PLUGINS_DIR`].
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Directory under the kubelet dir holding the PodResources socket.
pub const POD_RESOURCES_DIR: &str = "pod-resources";

/// What a simulated kubelet needs.
#[derive(Clone)]
pub struct KubeletConfig {
    /// Node name (also the `kubernetes.io/hostname` label).
    pub node_name: String,
    /// The node's kubelet directory (what `--kubelet-dir` of the plugin names).
    pub dir: PathBuf,
    /// Client for the API server.
    pub client: Client,
    /// Longest a deleted pod stays Terminating: the simulated grace period
    /// is `min(gracePeriodSeconds, max_termination)`.
    pub max_termination: Duration,
    /// Index of the node, used to give pods distinct simulated IPs.
    pub index: u32,
    /// Record each running pod's allocated environment in its annotation
    /// `sim.gpupool.io/allocated-env`, for tests to read. Only where the API
    /// server lets a kubelet write pod metadata: a real one (the Node
    /// authorizer) allows a kubelet only pod status.
    pub annotate_allocations: bool,
}

/// Why a kubelet could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// A socket could not be served.
    #[error(transparent)]
    Socket(#[from] TransportError),
    /// The Node could not be created.
    #[error("cannot register node {node}: {source}")]
    Node {
        /// Node name.
        node: String,
        /// API error.
        #[source]
        source: kube::Error,
    },
    /// A directory could not be read or a stale socket removed.
    #[error("kubelet directory {path}: {source}")]
    Dir {
        /// Path.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
}

/// How many accepted registrations [`RunningKubelet::registration_requests`]
/// keeps: a plugin registering in a loop must not grow the kubelet.
pub const KEPT_REGISTRATIONS: usize = 64;

/// Mutable node state, behind one lock held only briefly (never across I/O).
#[derive(Default)]
pub struct NodeState {
    /// Devices and their holders.
    pub book: DeviceBook,
    /// Registered plugins by resource name.
    pub plugins: BTreeMap<String, PluginEndpoint>,
    /// Running pods (namespace, name), with or without devices.
    pub running: BTreeSet<(String, String)>,
    /// The last ListAndWatch list of each registered plugin, as sent.
    pub listed: BTreeMap<String, Vec<Device>>,
    /// The last [`KEPT_REGISTRATIONS`] accepted registrations, oldest first.
    registrations: VecDeque<RegisterRequest>,
}

impl NodeState {
    /// Keeps an accepted registration, dropping the oldest beyond
    /// [`KEPT_REGISTRATIONS`].
    pub fn record_registration(&mut self, request: RegisterRequest) {
        if self.registrations.len() == KEPT_REGISTRATIONS {
            self.registrations.pop_front();
        }
        self.registrations.push_back(request);
    }
}

/// What every part of one kubelet shares.
pub struct Shared {
    /// Node name.
    pub node_name: String,
    /// Kubelet directory.
    pub dir: PathBuf,
    /// API client.
    pub client: Client,
    /// Simulated termination cap.
    pub max_termination: Duration,
    index: u32,
    /// See [`KubeletConfig::annotate_allocations`].
    pub annotate_allocations: bool,
    state: Mutex<NodeState>,
    generation: AtomicU64,
    pod_ips: AtomicU64,
    /// Woken when devices change, so the Node status follows.
    pub node_dirty: Notify,
    /// Number of successful plugin registrations so far.
    pub registered: watch::Sender<u64>,
}

impl Shared {
    /// Locks the node state; a poisoned lock is taken over (the state is
    /// plain data, valid after any panic in a reader).
    pub fn lock(&self) -> MutexGuard<'_, NodeState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn next_generation(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A fresh simulated pod IP on this node (10.244.<node>.<n>).
    pub fn pod_ip(&self) -> String {
        let n = self.pod_ips.fetch_add(1, Ordering::Relaxed);
        format!("10.244.{}.{}", self.index % 256, 2 + n % 250)
    }
}

/// A running kubelet. Dropping it stops its tasks; [`RunningKubelet::stop`]
/// also waits for them.
pub struct RunningKubelet {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    registration: Option<(CancellationToken, JoinHandle<()>)>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningKubelet {
    /// Creates the kubelet directories, serves the registration and
    /// PodResources sockets, registers the Node and starts running its pods.
    pub async fn start(config: KubeletConfig) -> Result<Self, KubeletError> {
        let shared = Arc::new(Shared {
            node_name: config.node_name,
            dir: config.dir,
            client: config.client,
            max_termination: config.max_termination,
            index: config.index,
            annotate_allocations: config.annotate_allocations,
            state: Mutex::new(NodeState::default()),
            generation: AtomicU64::new(0),
            pod_ips: AtomicU64::new(0),
            node_dirty: Notify::new(),
            registered: watch::Sender::new(0),
        });
        node::register_node(&shared)
            .await
            .map_err(|source| KubeletError::Node {
                node: shared.node_name.clone(),
                source,
            })?;
        let cancel = CancellationToken::new();
        let pr_path = shared.dir.join(POD_RESOURCES_DIR).join(KUBELET_SOCKET);
        let pr_incoming = bind_unix(&pr_path)?;
        let pr_router = tonic::transport::Server::builder().add_service(
            PodResourcesListerServer::new(podresources::PodResourcesService {
                shared: shared.clone(),
            }),
        );
        let pr_cancel = cancel.clone();
        let tasks = vec![
            tokio::spawn(async move {
                if let Err(e) = serve_incoming(
                    pr_router,
                    &pr_path,
                    pr_incoming,
                    pr_cancel.cancelled_owned(),
                )
                .await
                {
                    tracing::error!(error = %e, "PodResources server failed");
                }
            }),
            tokio::spawn(node::keep_status(shared.clone(), cancel.clone())),
            tokio::spawn(node::keep_lease(shared.clone(), cancel.clone())),
            tokio::spawn(pods::run(shared.clone(), cancel.clone())),
        ];
        let mut kubelet = Self {
            shared,
            cancel,
            registration: None,
            tasks,
        };
        kubelet.serve_registration()?;
        Ok(kubelet)
    }

    fn serve_registration(&mut self) -> Result<(), KubeletError> {
        let path = self.socket_path();
        let incoming = bind_unix(&path)?;
        let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(
            registration::RegistrationService {
                shared: self.shared.clone(),
            },
        ));
        let cancel = self.cancel.child_token();
        let stop = cancel.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = serve_incoming(router, &path, incoming, stop.cancelled_owned()).await {
                tracing::error!(error = %e, "registration server failed");
            }
        });
        self.registration = Some((cancel, task));
        tracing::info!(node = %self.shared.node_name, socket = %self.socket_path().display(), "kubelet serving registration");
        Ok(())
    }

    /// Restarts the kubelet's device-plugin side as a kubelet restart does:
    /// stops serving registration, forgets every plugin (their devices are
    /// unallocatable until they register again), deletes every socket in
    /// `device-plugins/` and serves a fresh `kubelet.sock`. Pods keep the
    /// devices they hold (kubelet's checkpoint).
    pub async fn restart(&mut self) -> Result<(), KubeletError> {
        if let Some((cancel, task)) = self.registration.take() {
            cancel.cancel();
            let _ = task.await;
        }
        {
            let mut state = self.shared.lock();
            let plugins = std::mem::take(&mut state.plugins);
            for (resource, plugin) in plugins {
                plugin.disconnect();
                state.book.mark_unhealthy(&resource);
            }
            state.listed.clear();
        }
        self.shared.node_dirty.notify_one();
        let dir = self.shared.dir.join(DEVICE_PLUGINS_DIR);
        let dir_error = |source| KubeletError::Dir {
            path: dir.clone(),
            source,
        };
        for entry in std::fs::read_dir(&dir).map_err(dir_error)? {
            let entry = entry.map_err(dir_error)?;
            let is_socket = {
                use std::os::unix::fs::FileTypeExt;
                entry.file_type().map_err(dir_error)?.is_socket()
            };
            if is_socket {
                std::fs::remove_file(entry.path()).map_err(dir_error)?;
            }
        }
        tracing::info!(node = %self.shared.node_name, "kubelet restarted: device-plugin sockets removed");
        self.serve_registration()
    }

    /// Node name.
    pub fn node_name(&self) -> &str {
        &self.shared.node_name
    }

    /// The kubelet directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Path of the registration socket.
    pub fn socket_path(&self) -> PathBuf {
        self.shared
            .dir
            .join(DEVICE_PLUGINS_DIR)
            .join(KUBELET_SOCKET)
    }

    /// Successful plugin registrations so far (every re-registration counts).
    pub fn registrations(&self) -> u64 {
        *self.shared.registered.borrow()
    }

    /// Waits until more than `seen` registrations happened, for at most `timeout`.
    /// Returns whether one did.
    pub async fn wait_registration(&self, seen: u64, timeout: Duration) -> bool {
        let mut rx = self.shared.registered.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|n| *n > seen))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// (capacity, allocatable) of `resource` as the kubelet's bookkeeping has it.
    pub fn devices(&self, resource: &str) -> (usize, usize) {
        let state = self.shared.lock();
        (
            state.book.capacity(resource),
            state.book.allocatable(resource),
        )
    }

    /// The last accepted plugin registrations (at most
    /// [`KEPT_REGISTRATIONS`]), oldest first, as the plugins sent them.
    pub fn registration_requests(&self) -> Vec<RegisterRequest> {
        self.shared.lock().registrations.iter().cloned().collect()
    }

    /// What the plugin registered for `resource` answered to
    /// GetDevicePluginOptions; `None` while none is registered.
    pub fn plugin_options(&self, resource: &str) -> Option<DevicePluginOptions> {
        self.shared.lock().plugins.get(resource).map(|p| p.options)
    }

    /// The last device list the plugin registered for `resource` sent on
    /// ListAndWatch, topology included; `None` before its first list, and
    /// again once the plugin is gone or the kubelet restarted.
    pub fn listed_devices(&self, resource: &str) -> Option<Vec<Device>> {
        self.shared.lock().listed.get(resource).cloned()
    }

    /// The device IDs of `resource` allocated to pod `namespace/name`, in
    /// container order; `None` when the pod holds no devices here.
    pub fn allocated_devices(
        &self,
        namespace: &str,
        name: &str,
        resource: &str,
    ) -> Option<Vec<String>> {
        let state = self.shared.lock();
        let pod = state
            .book
            .pods()
            .values()
            .find(|p| p.namespace == namespace && p.name == name)?;
        Some(
            pod.containers
                .iter()
                .filter(|c| c.resource == resource)
                .flat_map(|c| c.devices.iter().cloned())
                .collect(),
        )
    }

    /// Stops every task of this kubelet and waits for them.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some((_, task)) = self.registration.take() {
            let _ = task.await;
        }
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for RunningKubelet {
    fn drop(&mut self) {
        self.cancel.cancel();
        let state = self.shared.lock();
        for plugin in state.plugins.values() {
            plugin.disconnect();
        }
    }
}
